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
The Secret holding the operator's Admin signing key (Ed25519): made by the operator at its first
start, read by every replica; its public key goes into every policy's sidecar config.
*/}}
{{- define "binbatch.adminSigningSecretName" -}}
{{- printf "%s-admin-signing" (include "binbatch.fullname" .) | trunc 63 | trimSuffix "-" }}
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

{{/*
What the operator does in a namespace it serves: its policies, their children, the pods they
select, their Events, and the owners of injected pods. In the ClusterRole (every namespace) or
in a Role per watchNamespaces entry.
*/}}
{{- define "binbatch.policyRules" -}}
# The policies: watch them; patch for kopf's finalizer and progress annotations.
- apiGroups: ["binbatch.io"]
  resources: ["batchingpolicies"]
  verbs: ["get", "list", "watch", "patch"]
# Their status: conditions, observedGeneration, pods, batchSize, bins.
- apiGroups: ["binbatch.io"]
  resources: ["batchingpolicies/status"]
  verbs: ["get", "patch"]
# The children's ownerReferences set blockOwnerDeletion, which clusters running the
# OwnerReferencesPermissionEnforcement admission plugin allow only with this.
- apiGroups: ["binbatch.io"]
  resources: ["batchingpolicies/finalizers"]
  verbs: ["update"]
# Each policy's sidecar config ConfigMap (<policy>-binbatch): create it, patch it on a spec change.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Each policy's Service (<policy>-binbatch, ports grpc, http and metrics) in front of its sidecars,
# and with spec.service.headless its headless twin (<policy>-binbatch-headless). Children are owned
# by the policy and garbage-collected with it; delete only removes the headless Service when
# spec.service.headless is turned off.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Each policy's NetworkPolicy (<policy>-binbatch, networkPolicy.enabled): who reaches its sidecars.
# RBAC cannot limit verbs to labelled objects; the operator patches and deletes only the ones
# owned by a policy (owner reference), and with networkPolicy.enabled false only lists, watches
# and deletes the ones it made earlier.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  {{- if .Values.networkPolicy.enabled }}
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
  {{- else }}
  verbs: ["list", "watch", "delete"]
  {{- end }}
# The pods a policy selects: count them and read their sidecars' stats into the status.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# kopf posts Kubernetes events on the policies (core and events.k8s.io APIs).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
# The owners of injected pods: patch = a rollout restart when a policy is deleted, so
# its pods come back without the sidecar (a running pod's containers cannot be removed).
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["get", "patch"]
# A pod's owner is a ReplicaSet; reading it leads to the Deployment to restart.
- apiGroups: ["apps"]
  resources: ["replicasets"]
  verbs: ["get"]
{{- end }}
