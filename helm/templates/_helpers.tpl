{{/* Names ------------------------------------------------------------------------------------- */}}
{{- define "moa-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "moa-serve.fullname" -}}
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

{{/* "<fullname>-<component>", e.g. (include "moa-serve.component" (list . "gateway")) */}}
{{- define "moa-serve.component" -}}
{{- $ctx := index . 0 }}
{{- printf "%s-%s" (include "moa-serve.fullname" $ctx | trunc 55 | trimSuffix "-") (index . 1) }}
{{- end }}

{{- define "moa-serve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "moa-serve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels ------------------------------------------------------------------------------------ */}}
{{- define "moa-serve.selectorLabels" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "moa-serve.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "moa-serve.labels" -}}
{{- $ctx := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $ctx.Chart.Name $ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "moa-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ $ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $ctx.Release.Service }}
app.kubernetes.io/part-of: moa-serve
{{- with $ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Images: a component's image overrides the chart-wide one field by field; a digest wins over the tag. */}}
{{- define "moa-serve.image" -}}
{{- $ctx := index . 0 }}
{{- $img := merge (deepCopy (index . 1 | default dict)) $ctx.Values.image }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (toString (default $ctx.Chart.AppVersion $img.tag)) }}
{{- end }}
{{- end }}

{{- define "moa-serve.imagePullPolicy" -}}
{{- $ctx := index . 0 }}
{{- (index . 1 | default dict).pullPolicy | default $ctx.Values.image.pullPolicy }}
{{- end }}

{{/* Models ------------------------------------------------------------------------------------ */}}
{{/* What the server loads: an explicit path; else the downloaded copy on the cache when the init step runs; else the name. */}}
{{- define "moa-serve.localPath" -}}
{{- $ctx := index . 0 }}
{{- $m := index . 1 }}
{{- if $m.path }}
{{- $m.path }}
{{- else if and $ctx.Values.modelCache.init.enabled (not (hasPrefix "/" $m.name)) }}
{{- printf "%s/%s" $ctx.Values.modelCache.mountPath $m.name }}
{{- else }}
{{- $m.name }}
{{- end }}
{{- end }}

{{- define "moa-serve.servedModelName" -}}
{{- default .Values.model.name .Values.model.servedName }}
{{- end }}

{{/* Drafter name as the gateway reports it in the `drafter` metric label. */}}
{{- define "moa-serve.drafterLabel" -}}
{{- default (lower .Values.drafter.algorithm) .Values.gateway.drafterLabel }}
{{- end }}

{{/* Upstream the gateway talks to: the router when enabled, else the SGLang Service. */}}
{{- define "moa-serve.upstreamURL" -}}
{{- if .Values.router.enabled }}
{{- printf "http://%s:%d" (include "moa-serve.component" (list . "router")) (.Values.router.port | int) }}
{{- else }}
{{- printf "http://%s:%d" (include "moa-serve.component" (list . "sglang")) (.Values.sglang.port | int) }}
{{- end }}
{{- end }}

{{/* Cross-field checks that the schema cannot express; included by every workload template. */}}
{{- define "moa-serve.validate" -}}
{{- $v := .Values }}
{{- if and $v.gateway.ingress.enabled (not $v.gateway.apiKeys.existingSecret) (not $v.gateway.apiKeys.allowUnauthenticated) }}
{{- fail "gateway.ingress.enabled exposes the API: set gateway.apiKeys.existingSecret (or gateway.apiKeys.allowUnauthenticated=true)" }}
{{- end }}
{{- $scaled := or (gt ($v.sglang.replicaCount | int) 1) $v.autoscaling.enabled }}
{{- $sharedRWO := and (eq $v.modelCache.type "pvc") (not $v.modelCache.pvc.existingClaim) (eq $v.sglang.kind "Deployment") (has "ReadWriteOnce" $v.modelCache.pvc.accessModes) }}
{{- if and $scaled $sharedRWO }}
{{- fail "several SGLang replicas cannot share one ReadWriteOnce model-cache PVC: use sglang.kind=StatefulSet, a ReadWriteMany claim, modelCache.pvc.existingClaim or modelCache.type=hostPath" }}
{{- end }}
{{- if and $v.training.enabled (eq $v.modelCache.type "emptyDir") }}
{{- fail "training.enabled writes the drafter onto the model cache the servers read: modelCache.type must be pvc or hostPath" }}
{{- end }}
{{- if and $v.training.enabled (eq $v.modelCache.type "pvc") (not $v.modelCache.pvc.existingClaim) (eq $v.sglang.kind "StatefulSet") }}
{{- fail "training.enabled needs one model cache shared with the servers: a StatefulSet's per-pod claims are not; set modelCache.pvc.existingClaim" }}
{{- end }}
{{- if gt ($v.sglang.tensorParallelSize | default $v.sglang.gpus | int) ($v.sglang.gpus | int) }}
{{- fail "sglang.tensorParallelSize must not exceed sglang.gpus" }}
{{- end }}
{{- end }}

{{/* HF_TOKEN from model.hfTokenSecret; use as: include ... | nindent N, only when the secret name is set. */}}
{{- define "moa-serve.hfTokenEnv" -}}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ .Values.model.hfTokenSecret.name }}, key: {{ .Values.model.hfTokenSecret.key }}}
{{- end }}
