{{/* Names and labels. */}}
{{- define "igw.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "igw.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "igw.selectorLabels" -}}
app.kubernetes.io/name: {{ include "igw.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "igw.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "igw.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: inference-gateway
{{- end }}

{{- define "igw.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "igw.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Namespace of the model-server pods. */}}
{{- define "igw.podNamespace" -}}
{{- default .Release.Namespace .Values.discovery.podNamespace }}
{{- end }}

{{/* Name of the InferenceGatewayConfig object followed when configResource.enabled. */}}
{{- define "igw.configResourceName" -}}
{{- default .Values.config.metadata.name .Values.configResource.name }}
{{- end }}

{{/* Names and selector labels of the bundled Redis (never the gateway's selector). */}}
{{- define "igw.redisName" -}}
{{- printf "%s-redis" (include "igw.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "igw.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-redis" (include "igw.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "igw.redisLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "igw.redisSelectorLabels" . }}
app.kubernetes.io/component: coordination
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: inference-gateway
{{- end }}

{{/* Where the coordination password Secret is mounted, and the file the picker reads. */}}
{{- define "igw.coordinationDir" -}}/etc/igw-coordination{{- end }}
{{- define "igw.coordinationPasswordFile" -}}{{ include "igw.coordinationDir" . }}/password{{- end }}
{{- define "igw.coordinationCaDir" -}}/etc/igw-coordination-ca{{- end }}
{{- define "igw.tenantKeysDir" -}}/etc/igw-tenant-keys{{- end }}
{{- define "igw.tenantKeysFile" -}}{{ include "igw.tenantKeysDir" . }}/keys{{- end }}
{{- define "igw.coordinationCaFile" -}}{{ include "igw.coordinationCaDir" . }}/ca.pem{{- end }}

{{/* The Redis URL of spec.coordination: coordination.url, the bundled Redis, or empty. */}}
{{- define "igw.coordinationURL" -}}
{{- $c := .Values.coordination }}
{{- if and $c.url $c.bundled.enabled }}
{{- fail "coordination: set url (an external Redis) or bundled.enabled (a trial Redis in the release), not both" }}
{{- end }}
{{- if $c.url }}
{{- if not (regexMatch "^rediss?://[^/]+" $c.url) }}
{{- fail (printf "coordination.url: must be redis://HOST:PORT/DB or rediss://HOST:PORT/DB (TLS); got %q" $c.url) }}
{{- end }}
{{- $c.url }}
{{- else if $c.bundled.enabled }}
{{- printf "redis://%s.%s.svc:6379/0" (include "igw.redisName" .) .Release.Namespace }}
{{- else if $c.existingSecret }}
{{- fail "coordination.existingSecret: needs coordination.url or coordination.bundled.enabled" }}
{{- end }}
{{- end }}

{{/* The gateway config as mounted: values.config, with the TLS Secret's files when
set and spec.coordination when coordination is configured. */}}
{{- define "igw.config" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $tls := deepCopy ($cfg.spec.tls | default dict) }}
{{- if .Values.tls.secretName }}
{{- $tls = merge (dict "certificateFile" "/etc/igw-tls/tls.crt" "keyFile" "/etc/igw-tls/tls.key" "secretName" .Values.tls.secretName) $tls }}
{{- end }}
{{- if .Values.tls.clientCaSecret }}
{{- $_ := set $tls "clientCaFile" "/etc/igw-client-ca/ca.pem" }}
{{- end }}
{{- if .Values.tls.requireClientCertificate }}
{{- if not $tls.clientCaFile }}
{{- fail "tls.requireClientCertificate: needs tls.clientCaSecret (the CA client certificates are verified with)" }}
{{- end }}
{{- $_ := set $tls "requireClientCertificate" true }}
{{- end }}
{{- if $tls }}
{{- $_ := set $cfg.spec "tls" $tls }}
{{- end }}
{{- $url := include "igw.coordinationURL" . }}
{{- if $url }}
{{- $coord := dict "url" $url }}
{{- if .Values.coordination.existingSecret }}
{{- $_ := set $coord "passwordFile" (include "igw.coordinationPasswordFile" .) }}
{{- end }}
{{- if .Values.coordination.username }}
{{- $_ := set $coord "username" .Values.coordination.username }}
{{- end }}
{{- if .Values.coordination.caConfigMap }}
{{- if not (hasPrefix "rediss://" $url) }}
{{- fail "coordination.caConfigMap: needs a rediss:// coordination.url (TLS)" }}
{{- end }}
{{- $_ := set $coord "caFile" (include "igw.coordinationCaFile" .) }}
{{- end }}
{{- $coord = merge $coord (deepCopy (.Values.coordination.settings | default dict)) (deepCopy (dig "coordination" dict $cfg.spec)) }}
{{- /* The picker's default prefix is igw:<metadata.namespace or "default">:<name>; a
ConfigMap's config rarely names its namespace, so two releases sharing one Redis
would share keys. Default it to the release namespace instead. */}}
{{- if not $coord.keyPrefix }}
{{- $ns := dig "metadata" "namespace" .Release.Namespace $cfg }}
{{- $_ := set $coord "keyPrefix" (printf "igw:%s:%s" $ns (dig "metadata" "name" "inference-gateway" $cfg)) }}
{{- end }}
{{- $_ := set $cfg.spec "coordination" $coord }}
{{- end }}
{{- if .Values.tenants.keysSecret }}
{{- if not (dig "tenants" "list" nil $cfg.spec) }}
{{- fail "tenants.keysSecret: needs config.spec.tenants.list (the tenants the keys belong to)" }}
{{- end }}
{{- $_ := set $cfg.spec.tenants "keysFile" (include "igw.tenantKeysFile" .) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{- define "igw.listenPort" -}}
{{- dig "listener" "port" 8443 .Values.config.spec }}
{{- end }}

{{- define "igw.pickerPort" -}}
{{- dig "ports" "picker" 9002 .Values.config.spec }}
{{- end }}
