{{/*
Render-time checks: a bad value stops `helm install/upgrade/template` with a message that names the key,
instead of producing objects the API server or the pods would reject later.
*/}}
{{- define "dynamig.validate" -}}
{{- $v := .Values -}}
{{- if not (has $v.logging.format (list "text" "json")) -}}
{{- fail (printf "logging.format must be \"text\" or \"json\", got %q" (toString $v.logging.format)) -}}
{{- end -}}
{{- if not (has $v.logging.level (list "debug" "info" "warning" "error")) -}}
{{- fail (printf "logging.level must be one of debug, info, warning, error; got %q" (toString $v.logging.level)) -}}
{{- end -}}
{{- if not $v.image.repository -}}
{{- fail "image.repository must be set" -}}
{{- end -}}
{{- if and $v.image.digest (not (regexMatch "^sha256:[a-f0-9]{64}$" (toString $v.image.digest))) -}}
{{- fail (printf "image.digest must be sha256: and 64 lowercase hex digits (the image manifest's digest), got %q" (toString $v.image.digest)) -}}
{{- end -}}
{{- $ns := include "dynamig.namespace" . -}}
{{- if and $v.namespaceOverride (not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" (toString $v.namespaceOverride))) -}}
{{- fail (printf "namespaceOverride must be a namespace name (a DNS label), got %q" (toString $v.namespaceOverride)) -}}
{{- end -}}
{{- if eq $ns "default" -}}
{{- fail "the release namespace is default: install dynamig in a namespace of its own (e.g. --namespace dynamig-system --create-namespace); the agent runs privileged and its Roles, Leases and Events live there" -}}
{{- end -}}
{{- if not (or $v.operator.enabled $v.agent.enabled) -}}
{{- fail "operator.enabled and agent.enabled are both false: nothing to deploy" -}}
{{- end -}}
{{- if $v.operator.enabled -}}
{{- if or (lt (int $v.operator.replicas) 1) (gt (int $v.operator.replicas) 5) -}}
{{- fail (printf "operator.replicas must be between 1 and 5 (only one acts at a time), got %v" $v.operator.replicas) -}}
{{- end -}}
{{- if or (lt (int $v.operator.metricsPort) 1) (gt (int $v.operator.metricsPort) 65535) -}}
{{- fail (printf "operator.metricsPort must be a port number (1-65535), got %v" $v.operator.metricsPort) -}}
{{- end -}}
{{- if eq (int $v.operator.healthPort) (int $v.operator.metricsPort) -}}
{{- fail (printf "operator.healthPort and operator.metricsPort are both %v: the liveness probe and /metrics need ports of their own" $v.operator.metricsPort) -}}
{{- end -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" (toString $v.operator.peering.name)) -}}
{{- fail (printf "operator.peering.name must be a DNS label, got %q" (toString $v.operator.peering.name)) -}}
{{- end -}}
{{- end -}}
{{- if $v.agent.enabled -}}
{{- if not (hasPrefix "/" (toString $v.agent.kubeletDir)) -}}
{{- fail (printf "agent.kubeletDir must be an absolute path, got %q" (toString $v.agent.kubeletDir)) -}}
{{- end -}}
{{- if not (hasPrefix "/" (toString $v.agent.cdiRoot)) -}}
{{- fail (printf "agent.cdiRoot must be an absolute path, got %q" (toString $v.agent.cdiRoot)) -}}
{{- end -}}
{{- if not (has $v.agent.nvml.mode (list "runtimeClass" "hostDriverRoot" "simulated")) -}}
{{- fail (printf "agent.nvml.mode must be \"runtimeClass\", \"hostDriverRoot\" or \"simulated\", got %q" (toString $v.agent.nvml.mode)) -}}
{{- end -}}
{{- if and (eq $v.agent.nvml.mode "simulated") (not (hasPrefix "/" (toString (($v.agent.nvml.simulated).hostDir)))) -}}
{{- fail (printf "agent.nvml.simulated.hostDir must be an absolute path when agent.nvml.mode is simulated, got %q" (toString (($v.agent.nvml.simulated).hostDir))) -}}
{{- end -}}
{{- if and (eq $v.agent.nvml.mode "runtimeClass") (not $v.agent.nvml.runtimeClassName) -}}
{{- fail "agent.nvml.runtimeClassName must be set when agent.nvml.mode is runtimeClass" -}}
{{- end -}}
{{- if and (eq $v.agent.nvml.mode "hostDriverRoot") (not (hasPrefix "/" (toString $v.agent.nvml.driverRoot))) -}}
{{- fail (printf "agent.nvml.driverRoot must be an absolute path when agent.nvml.mode is hostDriverRoot, got %q" (toString $v.agent.nvml.driverRoot)) -}}
{{- end -}}
{{- $maxLease := int (include "dynamig.maxLeaseSeconds" .) -}}
{{- if or (lt (int $v.agent.leaseSeconds) 1) (gt (int $v.agent.leaseSeconds) $maxLease) -}}
{{- fail (printf "agent.leaseSeconds must be between 1 and %d (the operator counts at most %d s of a Lease and the agent admission policy refuses a longer one), got %v" $maxLease $maxLease $v.agent.leaseSeconds) -}}
{{- end -}}
{{- range $v.agent.extraArgs -}}
{{- if hasPrefix "--lease-seconds" (toString .) -}}
{{- fail (printf "agent.extraArgs sets %s: use agent.leaseSeconds (checked against what the agent admission policy accepts)" (toString .)) -}}
{{- end -}}
{{- end -}}
{{- if or (lt (int $v.agent.metricsPort) 1) (gt (int $v.agent.metricsPort) 65535) -}}
{{- fail (printf "agent.metricsPort must be a port number (1-65535), got %v" $v.agent.metricsPort) -}}
{{- end -}}
{{- with (($v.agent.updateStrategy).rollingUpdate) -}}
{{- if and (hasKey . "maxSurge") (not (has (toString .maxSurge) (list "0" "0%"))) -}}
{{- fail (printf "agent.updateStrategy.rollingUpdate.maxSurge must be 0, got %v: two agents on one node would serve the same kubelet plugin sockets and GPUs" .maxSurge) -}}
{{- end -}}
{{- end -}}
{{- if and $v.namespace.create (ne (toString $v.namespace.podSecurityEnforce) "privileged") -}}
{{- fail (printf "namespace.podSecurityEnforce is %q: the agent runs privileged (NVML, /dev, host paths) and its pods would be refused; use privileged (the operator's pod passes restricted on its own)" (toString $v.namespace.podSecurityEnforce)) -}}
{{- end -}}
{{- /* An existing namespace (helm install -n NS): read its Pod Security label; offline rendering sees none. */ -}}
{{- with (lookup "v1" "Namespace" "" $ns) -}}
{{- $enforce := index (.metadata.labels | default dict) "pod-security.kubernetes.io/enforce" | default "" -}}
{{- if and $enforce (ne $enforce "privileged") (not $v.namespace.create) -}}
{{- fail (printf "namespace %s enforces the %q Pod Security level (label pod-security.kubernetes.io/enforce): the agent runs privileged and its pods would be refused; label the namespace privileged or install dynamig in another one" .metadata.name $enforce) -}}
{{- end -}}
{{- end -}}
{{- if empty $v.agent.nodeSelector -}}
{{- fail "agent.nodeSelector is empty: the privileged agent would run on every node; select GPU nodes (default dynamig.io/managed: \"true\")" -}}
{{- end -}}
{{- end -}}
{{- if and $v.metrics.serviceMonitor.enabled (not (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor")) (not $v.metrics.serviceMonitor.skipCapabilityCheck) -}}
{{- fail "metrics.serviceMonitor.enabled is true but the cluster does not serve monitoring.coreos.com/v1 ServiceMonitor (install the Prometheus Operator, or set metrics.serviceMonitor.skipCapabilityCheck=true when rendering offline)" -}}
{{- end -}}
{{- if and $v.metrics.prometheusRule.enabled (not (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PrometheusRule")) (not $v.metrics.prometheusRule.skipCapabilityCheck) -}}
{{- fail "metrics.prometheusRule.enabled is true but the cluster does not serve monitoring.coreos.com/v1 PrometheusRule (install the Prometheus Operator, or set metrics.prometheusRule.skipCapabilityCheck=true when rendering offline)" -}}
{{- end -}}
{{- if $v.uninstall.hook -}}
{{- if gt (add (int $v.uninstall.timeoutSeconds) 60) (int $v.uninstall.activeDeadlineSeconds) -}}
{{- fail (printf "uninstall.timeoutSeconds (%v) does not fit in uninstall.activeDeadlineSeconds (%v): the Job needs the wait plus 60 s to pull its image and remove what is left; raise the deadline (and helm uninstall --timeout) or lower the wait" $v.uninstall.timeoutSeconds $v.uninstall.activeDeadlineSeconds) -}}
{{- end -}}
{{- end -}}
{{- with $v.metrics.networkPolicy -}}
{{- if and .enabled (not .allowAll) (not (hasKey . "from")) -}}
{{- fail "metrics.networkPolicy.from is null, which would admit every source to the metrics ports: list the peers allowed to scrape, [] for none, or set metrics.networkPolicy.allowAll=true" -}}
{{- end -}}
{{- end -}}
{{- with $v.metrics.prometheusRule.runbookBaseURL -}}
{{- if or (not (regexMatch "^https?://[^/?#\\s]+" (toString .))) (contains "#" (toString .)) -}}
{{- fail (printf "metrics.prometheusRule.runbookBaseURL must be an absolute http(s) URL without a #fragment (each alert adds its own), got %q" (toString .)) -}}
{{- end -}}
{{- end -}}
{{- if and (lt (int $v.metrics.prometheusRule.pendingClaimSeconds) 60) $v.metrics.prometheusRule.enabled -}}
{{- fail (printf "metrics.prometheusRule.pendingClaimSeconds must be at least 60, got %v" $v.metrics.prometheusRule.pendingClaimSeconds) -}}
{{- end -}}
{{- end -}}
