# gpu-manager image: the Python agent, the interceptor libcuda-control.so and the default config.
# Build: docker build -t gpu-manager:0.1.0 .   (see docs/deploying.md)
# The RUN steps live in scripts/image-build-steps.sh, which CI also runs outside Docker.

FROM python:3.11-slim-bookworm AS build
# Debian point releases drop old package versions, so pinned apt versions would break the build
# within months; the toolchain comes from the pinned base image's release instead.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev make \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# .git is not sent to the build: the commit the image is built from is passed in, for
# `gpu-manager --version` and gpu_manager_build_info (docker build --build-arg GPU_MANAGER_COMMIT=$(git rev-parse HEAD)).
ARG GPU_MANAGER_COMMIT=""
COPY . .
RUN scripts/image-build-steps.sh --prefix / --work /tmp/build vcuda python config verify

FROM python:3.11-slim-bookworm
LABEL org.opencontainers.image.title="gpu-manager" \
      org.opencontainers.image.description="Kubernetes node agent sharing NVIDIA GPUs between containers" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/gpu-manager /opt/gpu-manager
COPY --from=build /usr/local/lib/gpu-manager /usr/local/lib/gpu-manager
COPY --from=build /etc/gpu-manager /etc/gpu-manager
ENV PATH=/opt/gpu-manager/bin:$PATH \
    LOG_LEVEL=2 \
    EXTRA_FLAGS=""
EXPOSE 5678
# As upstream's start.sh, without its copying script and ldconfig: the driver is read in place
# from the host's / mounted at /usr/local/host; NVML is loaded from the mirrored origin volume.
CMD ["/bin/sh", "-c", "exec gpu-manager --extra-config=/etc/gpu-manager/extra-config.json --v=${LOG_LEVEL} --hostname-override=${NODE_NAME} --share-mode=true --volume-config=/etc/gpu-manager/volume.conf --log-dir=/var/log/gpu-manager --query-addr=0.0.0.0 --driver-root=/usr/local/host --vcuda-library=/usr/local/lib/gpu-manager/libcuda-control.so --nvml-lib=/etc/gpu-manager/vdriver/origin/lib64/libnvidia-ml.so.1 ${EXTRA_FLAGS}"]
