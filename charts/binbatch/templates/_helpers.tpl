{{/*
Expand the name of the chart.
*/}}
{{- define "binbatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
We truncate at 63 chars because some Kubernetes name fields are limited to this (by the DNS naming spec).
If release name contains chart name it will be used as a full name.
*/}}
{{- define "binbatch.fullname" -}}
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

{{/*
Create chart name and version as used by the chart label.
*/}}
{{- define "binbatch.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels
*/}}
{{- define "binbatch.labels" -}}
helm.sh/chart: {{ include "binbatch.chart" . }}
{{ include "binbatch.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Selector labels
*/}}
{{- define "binbatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "binbatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Create the name of the service account to use
*/}}
{{- define "binbatch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "binbatch.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The binbatch image (operator and, by default, sidecar).
*/}}
{{- define "binbatch.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
The admission webhook's Service.
*/}}
{{- define "binbatch.webhookServiceName" -}}
{{- printf "%s-webhook" (include "binbatch.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
"true" when the operator runs several replicas with kopf peering (one leader for the handlers).
*/}}
{{- define "binbatch.peering" -}}
{{- if gt (int .Values.operator.replicas) 1 }}true{{ end }}
{{- end }}

{{/*
The Secret holding the webhook's serving certificate: made by the operator (BuiltIn) or by
cert-manager (CertManager).
*/}}
{{- define "binbatch.webhookCertSecretName" -}}
{{- if eq .Values.webhook.certificate.source "CertManager" }}
{{- printf "%s-webhook-tls" (include "binbatch.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-webhook-cert" (include "binbatch.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
The DNS names the API server may use for the webhook Service (the certificate's SANs), then
the extra ones from values.
*/}}
{{- define "binbatch.webhookHostnames" -}}
{{- $svc := include "binbatch.webhookServiceName" . -}}
{{- $ns := .Release.Namespace -}}
{{- $names := list (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) (printf "%s.%s" $svc $ns) $svc -}}
{{- concat $names .Values.webhook.extraHostnames | uniq | toJson }}
{{- end }}
