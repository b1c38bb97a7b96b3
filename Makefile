# Entry points for a fresh machine: `make demo` runs the agent on a simulated GPU node,
# `make test` runs the checks and the tests. Both set up .venv and build vcuda/ first.
# The interpreter the venvs are made with (scripts/pick-python says which and why).
PYTHON ?= $(shell scripts/pick-python)
VENV := .venv
PY := $(VENV)/bin/python
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: demo demo-dra test test-known test-min-deps lint bench build clean proto deploy-check prometheus manifests

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# A path entry, as a wheel install has, instead of setuptools' default import hook for editable
	# installs, which every interpreter start loads (20-30 ms of each agent start); the default
	# where a setuptools no longer has the compat mode.
	$(PY) -m pip install --quiet -e '.[dev]' --config-settings editable_mode=compat 2>/dev/null \
	  || $(PY) -m pip install --quiet -e '.[dev]'
	# The test world (simnode/) is not part of the wheel: the dev venv finds it through a .pth file.
	$(PY) -c 'import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()["purelib"], "simnode-dev.pth").write_text("$(CURDIR)\n")'
	touch $@

build: $(VENV)/.installed
	$(MAKE) -C vcuda PYTHON=$(abspath $(PY))
	# Byte-compiled as a wheel install is: the agent's start does not compile its modules each time.
	$(PY) -m compileall -q gpumanager simnode >/dev/null

demo: build
	$(PY) -m simnode.demo

# DRA mode (ResourceSlices, claims, CDI) on the simulated node.
demo-dra: build
	$(PY) -m simnode.demo_dra

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check gpumanager simnode tests bench scripts
	$(VENV)/bin/ruff format --check gpumanager simnode tests bench scripts
	$(VENV)/bin/mypy

# The tests run in PYTEST_WORKERS processes (pytest-xdist): most of them wait on simulated
# processes and sockets rather than compute (six kept two cores about 60 % busy on average and
# finished in 7.5 minutes where four took 11), so six share two cores well. 0 runs them in one. A test
# that fails (some wait on threads of the agent that six processes on two cores can hold up for
# seconds) runs once more on its own; one that fails twice fails the run.
# Those marked timing measure a container's share of GPU time against tight bounds; a CPU taken by
# the other tests delays their limiters' threads, so they run afterwards, apart from them. Among
# themselves they run TIMING_WORKERS at a time: each waits on simulated GPU time (four of them kept
# the two cores 5-8 % busy), and one at a time they took 10 minutes of the run.
PYTEST_WORKERS ?= 6
TIMING_WORKERS ?= 4
# Those marked known_limit (every xfail: a limit not yet overcome, which its reason names) cannot fail the run and
# are left to `make test-known`.
test: build lint deploy-check prometheus
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) -m "not timing and not known_limit" || { echo "tests failed: running the failed ones once more, alone"; \
	  $(VENV)/bin/pytest -n 0 -m "not timing and not known_limit" --last-failed --last-failed-no-failures none; }
	$(VENV)/bin/pytest -n $(TIMING_WORKERS) -m "timing and not known_limit" || { echo "timing tests failed: running the failed ones once more, alone"; \
	  $(VENV)/bin/pytest -n 0 -m "timing and not known_limit" --last-failed --last-failed-no-failures none; }

# The known limits' measurements, one at a time: XPASS where one has been overcome.
test-known: build prometheus
	$(VENV)/bin/pytest -n 0 -rxX -m known_limit

# Debian's prometheus package (prometheus and promtool) for the alert, dashboard and metrics tests.
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  echo "installing Debian's prometheus package (prometheus, promtool)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# The declared minimum of every runtime dependency (scripts/min_constraints.py), in a venv of its
# own, with the end-to-end tests: a minimum that does not work fails here. As in `make test`, a test
# that fails runs once more on its own (with a cache of its own, so the main run's record of its
# failures stays as it was); one that fails twice fails the run.
MIN_VENV := .venv-min
MIN_CACHE := -o cache_dir=$(MIN_VENV)/pytest-cache
E2E_TESTS ?= tests/test_agent_kubelet.py tests/test_allocation_e2e.py tests/test_metrics_e2e.py tests/test_dra_e2e.py \
  tests/test_extender_verbs.py tests/test_multinode_scheduling.py tests/test_kube_lazy_package.py tests/test_kube_rest.py \
  tests/test_lazy_package_interop.py tests/test_kube_client.py
test-min-deps: build
	rm -rf $(MIN_VENV)
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PY) scripts/min_constraints.py > $(MIN_VENV)/constraints.txt
	$(MIN_VENV)/bin/python -m pip install --quiet -c $(MIN_VENV)/constraints.txt -e '.[dev]'
	$(MIN_VENV)/bin/python -c 'import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()["purelib"], "simnode-dev.pth").write_text("$(CURDIR)\n")'
	$(MIN_VENV)/bin/python scripts/min_constraints.py --verify
	$(MIN_VENV)/bin/pytest $(MIN_CACHE) -n $(PYTEST_WORKERS) $(E2E_TESTS) || { \
	  echo "tests failed on the minimum dependencies: running the failed ones once more, alone"; \
	  $(MIN_VENV)/bin/pytest $(MIN_CACHE) -n 0 --last-failed --last-failed-no-failures none $(E2E_TESTS); }

BENCHES ?= bench_registration bench_allocation bench_allocate_handler bench_metrics bench_volume bench_interceptor bench_compute bench_dra bench_vcuda_sock bench_extender bench_churn bench_pids_refresh bench_lagging_watch bench_pods_ending
bench: build
	for b in $(BENCHES); do echo "== $$b"; $(PY) bench/$$b.py || exit 1; done

# The deployable agent: hadolint on the Dockerfile, the manifests against the Kubernetes API
# schemas (kubernetes-validate, offline), and the image's build steps run outside Docker into a
# temporary prefix (scripts/image-build-steps.sh, the same script the Dockerfile runs).
K8S_VERSIONS ?= 1.30.0 1.37.0
DRA_K8S_VERSIONS ?= 1.35.0 1.37.0
deploy-check: $(VENV)/.installed
	$(VENV)/bin/hadolint --failure-threshold style Dockerfile
	$(PY) scripts/render_manifests.py --check
	for v in $(K8S_VERSIONS); do \
	  $(VENV)/bin/kubernetes-validate --strict --quiet -k $$v deploy/*.yaml deploy/dra/daemonset.yaml || exit 1; done
	# resource.k8s.io/v1 exists from 1.34; consumable capacity from 1.35 (feature gate) and 1.36 (default).
	for v in $(DRA_K8S_VERSIONS); do \
	  $(VENV)/bin/kubernetes-validate --strict --quiet -k $$v deploy/dra/*.yaml || exit 1; done
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  PYTHON=$(PYTHON) scripts/image-build-steps.sh --prefix "$$tmp/root" --work "$$tmp/work" \
	    vcuda python config verify

# deploy/daemonset.yaml and deploy/prometheus/gpu-manager.rules.yaml from the Helm chart.
manifests: $(VENV)/.installed
	$(PY) scripts/render_manifests.py

proto: $(VENV)/.installed
	$(PY) scripts/gen_proto.py

clean:
	$(MAKE) -C vcuda clean
