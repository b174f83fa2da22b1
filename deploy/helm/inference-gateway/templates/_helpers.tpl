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

{{/* The gateway config as mounted: values.config, with the TLS Secret's files when set. */}}
{{- define "igw.config" -}}
{{- $cfg := deepCopy .Values.config }}
{{- if .Values.tls.secretName }}
{{- $_ := set $cfg.spec "tls" (dict "certificateFile" "/etc/igw-tls/tls.crt" "keyFile" "/etc/igw-tls/tls.key" "secretName" .Values.tls.secretName) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{- define "igw.listenPort" -}}
{{- dig "listener" "port" 8443 .Values.config.spec }}
{{- end }}

{{- define "igw.pickerPort" -}}
{{- dig "ports" "picker" 9002 .Values.config.spec }}
{{- end }}
