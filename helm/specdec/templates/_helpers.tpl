{{/*
Names and labels. Component helpers take (dict "root" $ "component" "draft").
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every resource name: fullnameOverride, else "<release>-<chart name>"
(just the release name when it already contains the chart name). */}}
{{- define "specdec.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>": the name of a tier's objects. */}}
{{- define "specdec.componentName" -}}
{{- printf "%s-%s" (include "specdec.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* chart label value */}}
{{- define "specdec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels that select a tier's pods. */}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of a tier's objects. */}}
{{- define "specdec.labels" -}}
helm.sh/chart: {{ include "specdec.chart" .root }}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: specdec
{{- end }}

{{/* A tier's image: (dict "image" <the tier's image values> "override" <the top-level image, or "">);
the override where set (coordinator, draft and target pass .Values.image, redis ""), else "repository:tag". */}}
{{- define "specdec.image" -}}
{{- if .override }}{{ .override }}{{ else }}{{ printf "%s:%s" .image.repository (toString .image.tag) }}{{ end }}
{{- end }}

{{/* Whether a tier's replica count is left to an autoscaler ("true" or ""). */}}
{{- define "specdec.autoscaled" -}}
{{- if and .autoscaling .autoscaling.enabled }}true{{ end }}
{{- end }}

{{/* The Service names the coordinator watches. */}}
{{- define "specdec.draftService" -}}
{{- .Values.coordinator.discovery.draftService | default (include "specdec.componentName" (dict "root" . "component" "draft")) }}
{{- end }}
{{- define "specdec.targetService" -}}
{{- .Values.coordinator.discovery.targetService | default (include "specdec.componentName" (dict "root" . "component" "target")) }}
{{- end }}

{{/* The Secret holding the in-chart Redis password. */}}
{{- define "specdec.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (include "specdec.componentName" (dict "root" . "component" "redis")) }}
{{- end }}

{{/* The session store URL given to the coordinator (may reference $(REDIS_PASSWORD)). */}}
{{/* The REDIS_PASSWORD variable the Redis URL expands, where Redis has a password (else nothing). */}}
{{- define "specdec.redisPasswordEnv" -}}
{{- $redis := .Values.redis }}
{{- $secret := "" }}
{{- $key := "" }}
{{- if and $redis.enabled $redis.auth.enabled }}
{{- $secret = include "specdec.redisSecretName" . }}
{{- $key = $redis.auth.key }}
{{- else if and (not $redis.enabled) $redis.external.url $redis.external.existingSecret }}
{{- $secret = $redis.external.existingSecret }}
{{- $key = $redis.external.key }}
{{- end }}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $key }}
{{- end }}
{{- end }}

{{/* Whether a model tier keeps K/V chunks in Redis ("true" or ""). */}}
{{- define "specdec.kvStoreOn" -}}
{{- $v := index .root.Values .component }}
{{- if and $v.enabled $v.kvChunks.store }}true{{- end }}
{{- end }}

{{- define "specdec.sessionStore" -}}
{{- $redis := .Values.redis }}
{{- if $redis.enabled }}
{{- $host := printf "%s:%d" (include "specdec.componentName" (dict "root" . "component" "redis")) (int $redis.service.port) }}
{{- if $redis.auth.enabled }}
{{- printf "redis://:$(REDIS_PASSWORD)@%s/0" $host }}
{{- else }}
{{- printf "redis://%s/0" $host }}
{{- end }}
{{- else if $redis.external.url }}
{{- $parts := splitList "://" $redis.external.url }}
{{- if $redis.external.existingSecret }}
{{- printf "%s://:$(REDIS_PASSWORD)@%s" (index $parts 0) (index $parts 1) }}
{{- else }}
{{- $redis.external.url }}
{{- end }}
{{- else }}memory
{{- end }}
{{- end }}

{{/* Fail early on values that cannot work together. */}}
{{- define "specdec.validate" -}}
{{- range $tier := list "draft" "target" }}
{{- $model := (index $.Values $tier).model }}
{{- if and $model.kvCacheMemoryFraction (or (eq $model.device "cpu") (has $model.backend (list "torch" "llama.cpp"))) }}
{{- fail (printf "%s.model.kvCacheMemoryFraction sizes the graph backend's K/V pool on a CUDA device: set %s.model.device to cuda and %s.model.backend to graph (or auto), or kvCacheMemoryFraction to 0 and size the pool with kvCacheBytes" $tier $tier $tier) }}
{{- end }}
{{- if and (include "specdec.kvStoreOn" (dict "root" $ "component" $tier)) (not $.Values.redis.enabled) (not $.Values.redis.external.url) }}
{{- fail (printf "%s.kvChunks.store needs a Redis: redis.enabled, or redis.external.url" $tier) }}
{{- end }}
{{- end }}
{{- if and .Values.redis.enabled .Values.redis.external.url }}
{{- fail "redis.enabled and redis.external.url are both set: pick the in-chart Redis or the external one" }}
{{- end }}
{{- if and .Values.tls.internal.enabled (or (not .Values.tls.internal.serverSecret) (not .Values.tls.internal.clientSecret)) }}
{{- fail "tls.internal.enabled needs tls.internal.serverSecret and tls.internal.clientSecret" }}
{{- end }}
{{- if and .Values.tls.public.enabled (not .Values.tls.public.secretName) }}
{{- fail "tls.public.enabled needs tls.public.secretName" }}
{{- end }}
{{- if le (int .Values.coordinator.http.port) 0 }}
{{- if .Values.coordinator.http.readinessProbe }}
{{- fail "coordinator.http.readinessProbe needs the HTTP API: set coordinator.http.port above 0 (0 = off), or readinessProbe to false for the gRPC readiness probe" }}
{{- end }}
{{- if .Values.coordinator.http.ingress.enabled }}
{{- fail "coordinator.http.ingress.enabled needs the HTTP API: set coordinator.http.port above 0 (0 = off), or ingress.enabled to false" }}
{{- end }}
{{- end }}
{{- if and .Values.apiKey.enabled (not .Values.apiKey.existingSecret) }}
{{- fail "apiKey.enabled needs apiKey.existingSecret (a Secret holding the key)" }}
{{- end }}
{{- end }}
