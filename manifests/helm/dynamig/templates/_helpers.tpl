{{/* Names, labels and the image reference shared by every template. */}}

{{- define "dynamig.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dynamig.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dynamig.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{- define "dynamig.labels" -}}
app.kubernetes.io/name: {{ include "dynamig.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: dynamig
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "dynamig.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dynamig.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "dynamig.agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dynamig.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end -}}

{{- define "dynamig.operator.name" -}}{{ include "dynamig.fullname" . }}-operator{{- end -}}
{{- define "dynamig.agent.name" -}}{{ include "dynamig.fullname" . }}-agent{{- end -}}

{{- define "dynamig.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "dynamig.driverName" -}}mig.dynamig.io{{- end -}}
{{- /* The longest heartbeat Lease the operator counts (dynamig.kube.heartbeat.MAX_LEASE_SECONDS): the agent's
CLI, the chart's values and the Lease admission policy all stop there. */ -}}
{{- define "dynamig.maxLeaseSeconds" -}}300{{- end -}}

{{- /* KUBERNETES_SERVICE_HOST/PORT for every container when apiServer.host is set (values.yaml). */ -}}
{{- define "dynamig.apiServerEnv" -}}
{{- with .Values.apiServer.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $.Values.apiServer.port | quote }}
{{- end }}
{{- end -}}

{{- /* The agent container's securityContext: the chart's for the NVML mode, agent.securityContext merged over
it (values.yaml, docs/install.md "What the agent's container may do"). */ -}}
{{- define "dynamig.agent.securityContext" -}}
{{- $chart := dict "runAsUser" 0 "runAsNonRoot" false -}}
{{- if eq .Values.agent.nvml.mode "simulated" -}}
{{- $_ := set $chart "privileged" false -}}
{{- $_ := set $chart "allowPrivilegeEscalation" false -}}
{{- $_ := set $chart "readOnlyRootFilesystem" true -}}
{{- /* MKNOD: the simulated driver's device nodes are real character devices, made as instances appear. */ -}}
{{- $_ := set $chart "capabilities" (dict "drop" (list "ALL") "add" (list "MKNOD")) -}}
{{- else -}}
{{- $_ := set $chart "privileged" true -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite $chart (deepCopy (.Values.agent.securityContext | default dict))) -}}
{{- end -}}

{{- /* /metrics over TLS for allowed bearer tokens (metrics.secure): the Secret of the serving pair, where it is
mounted, and the component flags. */ -}}
{{- define "dynamig.metricsTlsSecret" -}}
{{- .Values.metrics.secure.tlsSecretName | default (printf "%s-metrics-tls" (include "dynamig.fullname" .)) -}}
{{- end -}}
{{- define "dynamig.metricsTlsDir" -}}/etc/dynamig/metrics-tls{{- end -}}
{{- define "dynamig.metricsSecureArgs" -}}
- --metrics-tls-cert-file={{ include "dynamig.metricsTlsDir" . }}/tls.crt
- --metrics-tls-key-file={{ include "dynamig.metricsTlsDir" . }}/tls.key
- --metrics-authorize
{{- end -}}
