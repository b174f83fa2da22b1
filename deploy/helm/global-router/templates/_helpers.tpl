{{/* Names and labels. */}}
{{- define "igr.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "igr.fullname" -}}
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

{{- define "igr.selectorLabels" -}}
app.kubernetes.io/name: {{ include "igr.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "igr.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "igr.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: inference-gateway
{{- end }}

{{/* Ports, from the config (the GlobalRouterConfig's defaults when absent). */}}
{{- define "igr.listenPort" -}}
{{- (.Values.config.spec.listener | default dict).port | default 8443 }}
{{- end }}

{{- define "igr.routerPort" -}}
{{- (.Values.config.spec.ports | default dict).picker | default 9012 }}
{{- end }}

{{/* Where the chart mounts what it is given. */}}
{{- define "igr.regionCaPath" -}}
{{- printf "/etc/igw-regions/%s/ca.pem" . }}
{{- end }}

{{- define "igr.coordinationURL" -}}
{{- .Values.coordination.url | default ((.Values.config.spec.coordination | default dict).url) | default "" }}
{{- end }}

{{/*
The GlobalRouterConfig as written to the ConfigMap: the values' config with the paths
of every mounted file filled in, after the checks a wrong value would otherwise only
show at start (or never: replicas without a shared Redis multiply every limit).
*/}}
{{- define "igr.config" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $spec := $cfg.spec }}
{{- $names := list }}
{{- $regions := list }}
{{- range $spec.regions }}
{{- $region := deepCopy . }}
{{- $names = append $names $region.name }}
{{- if hasKey $.Values.regionCAs $region.name }}
{{- $_ := set $region "caFile" (include "igr.regionCaPath" $region.name) }}
{{- end }}
{{- $regions = append $regions $region }}
{{- end }}
{{- range $name, $ca := .Values.regionCAs }}
{{- if not (has $name $names) }}
{{- fail (printf "regionCAs.%s: no region of config.spec.regions has that name" $name) }}
{{- end }}
{{- if or (and $ca.secretName $ca.configMap) (not (or $ca.secretName $ca.configMap)) }}
{{- fail (printf "regionCAs.%s: exactly one of secretName and configMap is required" $name) }}
{{- end }}
{{- end }}
{{- $_ := set $spec "regions" $regions }}
{{- if .Values.tls.secretName }}
{{- $_ := set $spec "tls" (dict "certificateFile" "/etc/igw-tls/tls.crt" "keyFile" "/etc/igw-tls/tls.key") }}
{{- end }}
{{- if .Values.regionClientTls.secretName }}
{{- $_ := set $spec "regionClientTls" (dict "certificateFile" "/etc/igw-region-client/tls.crt" "keyFile" "/etc/igw-region-client/tls.key") }}
{{- end }}
{{- if and .Values.coordination.existingSecret (not .Values.coordination.url) }}
{{- fail "coordination.existingSecret needs coordination.url" }}
{{- end }}
{{- if .Values.coordination.url }}
{{- $coord := merge (deepCopy .Values.coordination.settings) (dict "url" .Values.coordination.url) }}
{{- if .Values.coordination.existingSecret }}
{{- $_ := set $coord "passwordFile" "/etc/igw-coordination/password" }}
{{- end }}
{{- $_ := set $spec "coordination" $coord }}
{{- end }}
{{- if .Values.tenants.keysSecret }}
{{- if not $spec.tenants }}
{{- fail "tenants.keysSecret: config.spec.tenants (the tenants and their limits) is required with it" }}
{{- end }}
{{- $_ := set $spec.tenants "keysFile" "/etc/igw-tenants/keys" }}
{{- end }}
{{- if and $spec.tenants (gt (int .Values.replicaCount) 1) (not (include "igr.coordinationURL" .)) }}
{{- fail (printf "coordination.url: required with config.spec.tenants and %d replicas (each replica alone would admit the whole limit)" (int .Values.replicaCount)) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}
