{{/*
Objects shared by the tiers. Each takes (dict "root" $ "component" "<coordinator|draft|target>")
and renders nothing when the tier is disabled.
*/}}

{{/* The Deployment of a model tier (draft or target). */}}
{{- define "specdec.modelDeployment" -}}
{{- $root := .root }}
{{- $c := .component }}
{{- $v := index $root.Values $c }}
{{- if $v.enabled }}
{{- $ctx := dict "root" $root "component" $c }}
{{- $tls := $root.Values.tls.internal }}
{{- $tlsDir := "/etc/specdec/tls-internal" }}
{{- $execArgs := list }}
{{- if $tls.enabled }}
{{- $execArgs = list (printf "--ca-file=%s/ca.crt" $tlsDir) (printf "--cert-file=%s/tls.crt" $tlsDir) (printf "--key-file=%s/tls.key" $tlsDir) (printf "--server-name=%s" $tls.serverName) }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" $ctx | nindent 4 }}
  annotations:
    checkov.io/skip1: CKV_K8S_43=Images are pinned by tag (values); a digest depends on the registry the image is pushed to, set it in image.tag as "TAG@sha256:..." where wanted.
    checkov.io/skip2: CKV_K8S_35=HF_TOKEN is read from the environment by huggingface_hub (the flag contract); it comes from a Secret through secretKeyRef and is never logged.
    checkov.io/skip3: CKV_K8S_15=Images are pinned by tag, so IfNotPresent (the default) runs the same image as Always, and also one loaded into the nodes (kind, minikube); set pullPolicy Always where a tag is pushed again
spec:
  {{- if not (include "specdec.autoscaled" $v) }}
  replicas: {{ int $v.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "specdec.labels" $ctx | nindent 8 }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      automountServiceAccountToken: false
      securityContext:
        {{- include "specdec.podSecurityContext" . | nindent 8 }}
      {{- with (include "specdec.scheduling" (dict "root" $root "v" $v)) }}{{ . | nindent 6 }}{{- end }}
      terminationGracePeriodSeconds: 30
      containers:
        - name: {{ $c }}
          image: {{ include "specdec.image" (dict "image" $v.image "override" $root.Values.image) | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          args:
            - serve
            - {{ $c }}
            - --host=0.0.0.0
            - {{ printf "--port=%d" (int $v.service.port) | quote }}
            - {{ printf "--model=%s" $v.model.name | quote }}
            - {{ printf "--backend=%s" $v.model.backend | quote }}
            - {{ printf "--dtype=%s" $v.model.dtype | quote }}
            - {{ printf "--device=%s" $v.model.device | quote }}
            - {{ printf "--threads=%d" (int $v.model.threads) | quote }}
            - {{ printf "--kv-cache-type=%s" $v.model.kvCacheType | quote }}
            - {{ printf "--max-sessions=%d" (int64 $v.model.maxSessions) | quote }}
            - {{ printf "--kv-cache-bytes=%d" (int64 $v.model.kvCacheBytes) | quote }}
            {{- if and (eq $c "target") $v.heads }}
            - {{ printf "--heads=%s" $v.heads | quote }}
            {{- end }}
            {{- if $v.model.kvCacheMemoryFraction }}
            - {{ printf "--kv-cache-memory-fraction=%v" $v.model.kvCacheMemoryFraction | quote }}
            {{- end }}
            - {{ printf "--kv-chunk-tokens=%d" (int $v.kvChunks.chunkTokens) | quote }}
            - {{ printf "--prefix-cache-bytes=%d" (int64 $v.kvChunks.prefixCacheBytes) | quote }}
            {{- if $v.kvChunks.store }}
            - {{ printf "--kv-store-ttl-s=%d" (int $v.kvChunks.ttlSeconds) | quote }}
            {{- end }}
            - {{ printf "--metrics-port=%d" (int $root.Values.metrics.port) | quote }}
            {{- if $tls.enabled }}
            - {{ printf "--tls-cert-file=%s/tls.crt" $tlsDir | quote }}
            - {{ printf "--tls-key-file=%s/tls.key" $tlsDir | quote }}
            - {{ printf "--tls-client-ca-file=%s/ca.crt" $tlsDir | quote }}
            {{- end }}
            {{- range $v.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "specdec.hfEnv" $ctx | nindent 12 }}
            {{- if $v.kvChunks.store }}
            {{- with (include "specdec.redisPasswordEnv" $root) }}{{ . | nindent 12 }}{{- end }}
            - name: {{ printf "SPECDEC_%s_KV_STORE" (upper $c) }}
              value: {{ include "specdec.sessionStore" $root | quote }}
            {{- end }}
            {{- with $v.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            {{- include "specdec.ports" (dict "root" $root "port" $v.service.port) | nindent 12 }}
          {{- include "specdec.grpcProbes" (dict "probes" $v.probes "port" $v.service.port "service" (printf "specdec.v1.%s" (ternary "DraftService" "TargetService" (eq $c "draft"))) "execArgs" $execArgs) | nindent 10 }}
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          securityContext:
            {{- include "specdec.containerSecurityContext" . | nindent 12 }}
          volumeMounts:
            {{- include "specdec.commonMounts" $ctx | nindent 12 }}
            {{- if $tls.enabled }}
            - name: tls-internal
              mountPath: {{ $tlsDir }}
              readOnly: true
            {{- end }}
      volumes:
        {{- include "specdec.commonVolumes" (dict "root" $root "v" $v) | nindent 8 }}
        {{- if $tls.enabled }}
        - name: tls-internal
          secret:
            secretName: {{ $tls.serverSecret }}
            defaultMode: 0440
        {{- end }}
{{- end }}
{{- end }}

{{/* The headless Service of a model tier: no cluster IP, so its EndpointSlices list the ready pods
the coordinator routes to. */}}
{{- define "specdec.headlessService" -}}
{{- $root := .root }}
{{- $v := index $root.Values .component }}
{{- if $v.enabled }}
{{- $ctx := dict "root" $root "component" .component }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" $ctx | nindent 4 }}
  {{- with $v.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: ClusterIP
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "specdec.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ int $v.service.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- if gt (int $root.Values.metrics.port) 0 }}
    - name: metrics
      port: {{ int $root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
    {{- end }}
{{- end }}
{{- end }}

{{/* A HorizontalPodAutoscaler on CPU, when autoscaling is on and KEDA is not. */}}
{{- define "specdec.hpa" -}}
{{- $root := .root }}
{{- $v := index $root.Values .component }}
{{- if and $v.enabled $v.autoscaling.enabled (not $v.autoscaling.keda.enabled) }}
{{- $ctx := dict "root" $root "component" .component }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "specdec.componentName" $ctx }}
  minReplicas: {{ int $v.autoscaling.minReplicas }}
  maxReplicas: {{ int $v.autoscaling.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ int $v.autoscaling.targetCPUUtilizationPercentage }}
{{- end }}
{{- end }}

{{/* A KEDA ScaledObject with a Prometheus trigger, instead of the HPA. */}}
{{- define "specdec.scaledObject" -}}
{{- $root := .root }}
{{- $v := index $root.Values .component }}
{{- if and $v.enabled $v.autoscaling.enabled $v.autoscaling.keda.enabled }}
{{- $ctx := dict "root" $root "component" .component }}
{{- $k := $v.autoscaling.keda }}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "specdec.componentName" $ctx }}
  minReplicaCount: {{ int $v.autoscaling.minReplicas }}
  maxReplicaCount: {{ int $v.autoscaling.maxReplicas }}
  pollingInterval: {{ int $k.pollingInterval }}
  cooldownPeriod: {{ int $k.cooldownPeriod }}
  triggers:
    - type: prometheus
      metricType: {{ $k.metricType }}
      metadata:
        serverAddress: {{ $k.serverAddress | quote }}
        query: {{ tpl $k.query $root | quote }}
        threshold: {{ $k.threshold | toString | quote }}
{{- end }}
{{- end }}

{{/* A PodDisruptionBudget. */}}
{{- define "specdec.pdb" -}}
{{- $root := .root }}
{{- $v := index $root.Values .component }}
{{- if and $v.enabled $v.podDisruptionBudget.enabled }}
{{- $ctx := dict "root" $root "component" .component }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ $v.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- end }}

{{/* A Prometheus Operator ServiceMonitor on the tier's "metrics" Service port. */}}
{{- define "specdec.serviceMonitor" -}}
{{- $root := .root }}
{{- $v := index $root.Values .component }}
{{- if and $v.enabled $root.Values.metrics.serviceMonitor.enabled (gt (int $root.Values.metrics.port) 0) }}
{{- $ctx := dict "root" $root "component" .component }}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" $ctx | nindent 4 }}
    {{- with $root.Values.metrics.serviceMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" $ctx | nindent 6 }}
  namespaceSelector:
    matchNames:
      - {{ $root.Release.Namespace }}
  endpoints:
    - port: metrics
      path: /metrics
      interval: {{ $root.Values.metrics.serviceMonitor.interval }}
{{- end }}
{{- end }}

{{/* The NetworkPolicy of a model tier: its gRPC port only from the coordinator pods of this
release (and tierIngressFrom), its metrics port only from the monitoring namespaces. */}}
{{- define "specdec.tierNetworkPolicy" -}}
{{- $root := .root }}
{{- $v := index $root.Values .component }}
{{- if and $v.enabled $root.Values.networkPolicy.enabled }}
{{- $ctx := dict "root" $root "component" .component }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" $ctx | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "specdec.selectorLabels" $ctx | nindent 6 }}
  policyTypes:
    - Ingress
  ingress:
    - from:
        - podSelector:
            matchLabels:
              {{- include "specdec.selectorLabels" (dict "root" $root "component" "coordinator") | nindent 14 }}
        {{- with $root.Values.networkPolicy.tierIngressFrom }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - port: {{ int $v.service.port }}
          protocol: TCP
    {{- with (include "specdec.metricsIngress" $root) }}{{ . | nindent 4 }}{{ end }}
{{- end }}
{{- end }}

{{/* The ingress rule that lets the monitoring namespaces scrape the metrics port. */}}
{{- define "specdec.metricsIngress" -}}
{{- if gt (int .Values.metrics.port) 0 -}}
- from:
    - namespaceSelector:
        {{- toYaml .Values.networkPolicy.metricsNamespaceSelector | nindent 8 }}
  ports:
    - port: {{ int .Values.metrics.port }}
      protocol: TCP
{{- end }}
{{- end }}
