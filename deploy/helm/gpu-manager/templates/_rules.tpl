{{/*
The agent's alerts, as the groups of a Prometheus rule file. Rendered into the PrometheusRule,
and by scripts/render_manifests.py into deploy/prometheus/gpu-manager.rules.yaml for Prometheus
set up without the operator (both are tested with promtool).
*/}}
{{- define "gpu-manager.ruleGroups" -}}
{{- $job := printf "job=%q" .Values.prometheusRule.job -}}
groups:
  - name: gpu-manager
    rules:
      - alert: GPUManagerDown
        expr: up{ {{- $job -}} } == 0
        for: 5m
        labels:
          severity: critical
        annotations:
          summary: gpu-manager on {{`{{ $labels.instance }}`}} is down
          description: >-
            gpu-manager on {{`{{ $labels.instance }}`}} has not answered a scrape for 5 minutes:
            no GPU pod can be admitted or started on its node.
      {{- $daemonSets := prepend (.Values.prometheusRule.otherDaemonSets | default list) (printf "%s-daemonset" (include "gpu-manager.fullname" .)) }}
      {{- range $daemonSets }}
      {{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" (toString .)) }}
      {{- fail (printf "prometheusRule.otherDaemonSets: %q is not a DaemonSet name (lower-case letters, digits and '-')" (toString .)) }}
      {{- end }}
      {{- end }}
      {{- $ds := printf "namespace=%q,daemonset=%q" .Release.Namespace (first $daemonSets) }}
      {{- if gt (len $daemonSets) 1 }}
      {{- $ds = printf "namespace=%q,daemonset=~%q" .Release.Namespace (join "|" $daemonSets) }}
      {{- end }}
      {{- $desired := printf "sum(max by (daemonset) (kube_daemonset_status_desired_number_scheduled{%s}))" $ds }}
      {{- $named := list }}
      {{- range $daemonSets }}{{ $named = append $named (printf "%s/%s" $.Release.Namespace .) }}{{ end }}
      # Targets gone entirely (pod deleted and not recreated, node lost): their up series vanish, so
      # GPUManagerDown cannot fire. Compared with kube-state-metrics' desired count where it is scraped;
      # every target gone fires without it, unless kube-state-metrics says the DaemonSet wants no pod.
      - alert: GPUManagerTargetsMissing
        expr: >-
          (
            {{ $desired }}
            - (count(up{ {{- $job -}} }) or vector(0))
          ) > 0
          or on ()
          (
            absent(up{ {{- $job -}} })
            unless on () ({{ $desired }} == 0)
          )
        for: 10m
        labels:
          severity: critical
        annotations:
          summary: gpu-manager agents have no scrape target
          description: >-
            At least {{`{{ $value | humanize }}`}} gpu-manager agent(s) that {{ ternary "the DaemonSet" "the DaemonSets" (eq (len $daemonSets) 1) }} {{ join ", " $named }}
            should run have had no scrape target for 10 minutes (a pod deleted and not recreated, a lost
            node, or no agent left at all): GPU pods on their nodes can be neither admitted nor started,
            and GPUManagerDown does not fire for them.
      - alert: GPUManagerNotRegistered
        expr: gpu_manager_kubelet_registered{ {{- $job -}} } == 0
        for: 5m
        labels:
          severity: critical
        annotations:
          summary: gpu-manager on {{`{{ $labels.instance }}`}} is not registered with the kubelet
          description: >-
            The kubelet on {{`{{ $labels.instance }}`}} has not listed tencent.com/vcuda-core and
            tencent.com/vcuda-memory from gpu-manager (in DRA mode: has not registered its DRA driver)
            for 5 minutes: the node offers no GPU. See the agent's /readyz and its log.
      - alert: GPUManagerGPUUnhealthy
        expr: gpu_manager_gpu_healthy{ {{- $job -}} } == 0
        for: {{ .Values.prometheusRule.gpuUnhealthyFor }}
        labels:
          severity: warning
        annotations:
          summary: GPU {{`{{ $labels.gpu }}`}} on {{`{{ $labels.instance }}`}} is out of service
          description: >-
            GPU {{`{{ $labels.gpu }}`}} ({{`{{ $labels.uuid }}`}}) on {{`{{ $labels.instance }}`}} has been
            unhealthy (an XID critical error or a lost GPU) for {{ .Values.prometheusRule.gpuUnhealthyFor }};
            its devices are not offered to new pods.
      - alert: GPUManagerAllocationRefusals
        expr: increase(gpu_manager_kubelet_call_errors_total{ {{- $job -}} ,call=~"Allocate|PreStartContainer|NodePrepareResources"}[10m]) > 0
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: gpu-manager on {{`{{ $labels.instance }}`}} refuses {{`{{ $labels.call }}`}} calls
          description: >-
            {{`{{ $value | humanize }}`}} {{`{{ $labels.call }}`}} calls for {{`{{ $labels.resource }}`}} were
            refused in the last 10 minutes on {{`{{ $labels.instance }}`}}: those containers do not start.
            The agent's log names each pod and the reason.
      - alert: GPUManagerUnprepareFailures
        expr: increase(gpu_manager_kubelet_call_errors_total{ {{- $job -}} ,call="NodeUnprepareResources"}[10m]) > 0
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: gpu-manager on {{`{{ $labels.instance }}`}} fails to release DRA claims
          description: >-
            {{`{{ $value | humanize }}`}} NodeUnprepareResources calls for {{`{{ $labels.resource }}`}} failed
            in the last 10 minutes on {{`{{ $labels.instance }}`}}: the kubelet retries them, the pods
            using those claims stay Terminating and their claims are not released (their GPUs stay
            allocated). The agent's log names each claim and the reason.
      # DRA mode only: a feature gate the agent relies on, seen off on the API server (it dropped the
      # fields the gate guards from the node's ResourceSlice, or from a dry run of it: the agent checks
      # device taints at start, whatever the GPUs' health) or, for DRAConsumableCapacity, in
      # kube-scheduler (it allocated a claim without the capacity it asks for).
      - alert: GPUManagerDRAFeatureGateOff
        expr: gpu_manager_dra_feature_gate_off{ {{- $job -}} } == 1
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: gpu-manager on {{`{{ $labels.instance }}`}} finds DRA feature gate {{`{{ $labels.gate }}`}} off
          description: >-
            {{`{{ if eq $labels.gate "DRAConsumableCapacity" }}`}}The API server or kube-scheduler has had feature
            gate DRAConsumableCapacity off for 10 minutes, as seen by gpu-manager on {{`{{ $labels.instance }}`}}:
            the scheduler gives each GPU to one claim only, whole, and the node prepares every claim as a
            whole GPU without core or memory limits, so GPUs are not shared and claims asking for part of
            one wait for a free GPU. Turn the gate on on kube-apiserver, kube-scheduler and every kubelet
            (Kubernetes 1.35; on by default from 1.36). The alert clears at the agent's next ResourceSlice
            sync (within a minute) once the API server keeps the fields, and, for kube-scheduler, at the
            next claim on the node allocated the capacity it asks for.
            {{`{{- else if eq $labels.gate "DRADeviceTaints" }}`}}The API server has had feature gate
            DRADeviceTaints off for 10 minutes, as seen by gpu-manager on {{`{{ $labels.instance }}`}}: it drops
            device taints from the node's ResourceSlice, and kube-scheduler ignores them, so the node leaves
            its unhealthy GPUs out of the slice (no new claim gets them) until they are healthy again,
            instead of publishing them tainted. Turn the gate on on kube-apiserver and kube-scheduler; the
            alert clears at the agent's next ResourceSlice sync (within a minute) once the API server keeps
            device taints, whatever the GPUs' health.
            {{`{{- else }}`}}The API server or kube-scheduler has had feature gate {{`{{ $labels.gate }}`}} off for
            10 minutes, as seen by gpu-manager on {{`{{ $labels.instance }}`}}.{{`{{ end }}`}} The agent's /healthz
            (feature_gates_off, resourceslice-fields, scheduler-capacity) and its log say what was dropped
            or which claim was allocated without its capacity.
      - alert: GPUManagerContainerNearMemoryLimit
        expr: >-
          gpu_manager_container_gpu_memory_used_bytes{ {{- $job -}} }
          / gpu_manager_container_gpu_memory_limit_bytes{ {{- $job -}} } > {{ .Values.prometheusRule.memoryNearLimitRatio }}
          and (
            gpu_manager_container_gpu_core_limit_ratio{ {{- $job -}} } < 1
            or gpu_manager_container_gpu_memory_limit_bytes{ {{- $job -}} }
              < on (instance, gpu, uuid) group_left gpu_manager_gpu_memory_bytes{ {{- $job -}} }
          )
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: >-
            {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} container {{`{{ $labels.container }}`}} is near its GPU memory limit
          description: >-
            Container {{`{{ $labels.container }}`}} of {{`{{ $labels.namespace }}/{{ $labels.pod }}`}} uses
            {{`{{ $value | humanizePercentage }}`}} of its GPU memory limit on GPU {{`{{ $labels.gpu }}`}};
            its next allocations will fail with out-of-memory.
      # DRA mode: a share claim's limits hold for all its containers together (one vcuda.config, all their
      # PIDs in one pids.config), so several containers can fill it while none is near the limit alone. A
      # claim of one container is left to GPUManagerContainerNearMemoryLimit (its series carry the claim's limit).
      - alert: GPUManagerClaimNearMemoryLimit
        expr: >-
          gpu_manager_claim_gpu_memory_used_bytes{ {{- $job -}},share="true"}
          / gpu_manager_claim_gpu_memory_bytes{ {{- $job -}},share="true"} > {{ .Values.prometheusRule.memoryNearLimitRatio }}
          and on (instance, claim_uid)
            (sum by (instance, claim_uid) (gpu_manager_claim_containers{ {{- $job -}} }) > 1)
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: >-
            claim {{`{{ $labels.namespace }}/{{ $labels.claim }}`}} is near its GPU memory limit on GPU {{`{{ $labels.gpu }}`}}
          description: >-
            The containers using claim {{`{{ $labels.namespace }}/{{ $labels.claim }}`}} use
            {{`{{ $value | humanizePercentage }}`}} of its GPU memory limit on
            GPU {{`{{ $labels.gpu }}`}} ({{`{{ $labels.uuid }}`}}) together; their next allocations will fail with out-of-memory.
      - alert: GPUManagerCheckpointWriteFailures
        expr: increase(gpu_manager_checkpoint_write_failures_total{ {{- $job -}} }[10m]) > 0
        labels:
          severity: critical
        annotations:
          summary: gpu-manager on {{`{{ $labels.instance }}`}} cannot write its checkpoint
          description: >-
            The allocation checkpoint could not be written on {{`{{ $labels.instance }}`}} in the last
            10 minutes, so allocations are refused. Check the disk behind --checkpoint-path.
{{- end -}}
