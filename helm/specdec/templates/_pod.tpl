{{/*
Pod pieces every tier shares: security contexts, scheduling, cache and probes.
*/}}

{{/* Non-root, fixed UID/GID 10001 (the images' user), RuntimeDefault seccomp. */}}
{{- define "specdec.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Read-only root, no privilege escalation, no capabilities. */}}
{{- define "specdec.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* imagePullSecrets, nodeSelector, tolerations, affinity of a tier: (dict "root" $ "v" <tier values>). */}}
{{- define "specdec.scheduling" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Environment for the Hugging Face cache and token: (dict "root" $). */}}
{{- define "specdec.hfEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /cache
- name: HF_HOME
  value: /cache/huggingface
{{- with .root.Values.huggingface.tokenSecret }}
{{- if .name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- end }}

{{/* Mounts for /tmp, the cache and the model volume: (dict "root" $). */}}
{{- define "specdec.commonMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- if .root.Values.modelVolume.existingClaim }}
- name: models
  mountPath: {{ .root.Values.modelVolume.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Volumes for /tmp, the cache and the model volume: (dict "root" $ "v" <tier values>). */}}
{{- define "specdec.commonVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
- name: cache
  {{- if .v.cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .v.cache.existingClaim }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ .v.cache.sizeLimit }}
  {{- end }}
{{- if .root.Values.modelVolume.existingClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .root.Values.modelVolume.existingClaim }}
    readOnly: true
{{- end }}
{{- end }}

{{/* One probe's action: a native gRPC probe, or (when the port needs TLS or a key) the image's
specdec-healthcheck. (dict "port" N "service" NAME "execArgs" LIST) */}}
{{- define "specdec.probeAction" -}}
{{- if .execArgs -}}
exec:
  command:
    - specdec-healthcheck
    - {{ printf "127.0.0.1:%d" (int .port) | quote }}
    {{- if .service }}
    - {{ printf "--service=%s" .service | quote }}
    {{- end }}
    {{- range .execArgs }}
    - {{ . | quote }}
    {{- end }}
{{- else -}}
grpc:
  port: {{ int .port }}
  {{- if .service }}
  service: {{ .service }}
  {{- end }}
{{- end }}
{{- end }}

{{/* startup, liveness and readiness probes on grpc.health.v1: liveness checks the server (""),
readiness the tier's own service, or with "httpReadiness" (dict "port" N "scheme" HTTP|HTTPS) an
httpGet on GET /health of that port instead.
(dict "probes" <values> "port" N "service" NAME "execArgs" LIST ["httpReadiness" DICT]) */}}
{{- define "specdec.grpcProbes" -}}
{{- $p := .probes -}}
startupProbe:
  {{- include "specdec.probeAction" (dict "port" .port "execArgs" .execArgs) | nindent 2 }}
  periodSeconds: {{ int $p.startup.periodSeconds }}
  failureThreshold: {{ int $p.startup.failureThreshold }}
  timeoutSeconds: {{ int $p.liveness.timeoutSeconds }}
livenessProbe:
  {{- include "specdec.probeAction" (dict "port" .port "execArgs" .execArgs) | nindent 2 }}
  periodSeconds: {{ int $p.liveness.periodSeconds }}
  failureThreshold: {{ int $p.liveness.failureThreshold }}
  timeoutSeconds: {{ int $p.liveness.timeoutSeconds }}
readinessProbe:
  {{- with .httpReadiness }}
  httpGet:
    path: /health
    port: {{ int .port }}
    scheme: {{ .scheme }}
  {{- else }}
  {{- include "specdec.probeAction" (dict "port" .port "service" .service "execArgs" .execArgs) | nindent 2 }}
  {{- end }}
  periodSeconds: {{ int $p.readiness.periodSeconds }}
  failureThreshold: {{ int $p.readiness.failureThreshold }}
  timeoutSeconds: {{ int $p.readiness.timeoutSeconds }}
{{- end }}

{{/* The container ports of a specdec tier: (dict "root" $ "port" N). */}}
{{- define "specdec.ports" -}}
- name: grpc
  containerPort: {{ int .port }}
  protocol: TCP
{{- if gt (int .root.Values.metrics.port) 0 }}
- name: metrics
  containerPort: {{ int .root.Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end }}
