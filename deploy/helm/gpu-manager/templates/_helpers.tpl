{{/* The name of every object: the release name, or <release>-gpu-manager when it does not say gpu-manager. */}}
{{- define "gpu-manager.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The DaemonSet's selector: upstream's "name: gpu-manager-ds", so an in-place upgrade keeps the DaemonSet. */}}
{{- define "gpu-manager.selectorLabels" -}}
name: {{ include "gpu-manager.fullname" . }}-ds
{{- end -}}

{{- define "gpu-manager.labels" -}}
{{ include "gpu-manager.selectorLabels" . }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "gpu-manager.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* A flag value as the agent reads it: booleans as true/false, lists joined by commas. */}}
{{- define "gpu-manager.flagValue" -}}
{{- if kindIs "slice" . -}}
{{- join "," . -}}
{{- else if and (kindIs "float64" .) (eq (. | int64 | float64) .) -}}
{{- . | int64 -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* The agent's HTTP port: a --query-port in .Values.flags comes last on the command line and wins. */}}
{{- define "gpu-manager.port" -}}
{{- $f := .Values.flags | default dict -}}
{{- include "gpu-manager.flagValue" (coalesce (index $f "query-port") (index $f "query_port") .Values.port) -}}
{{- end -}}
