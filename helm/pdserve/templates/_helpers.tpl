{{/* Names, labels, and the one pod spec both worker pools are rendered from. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The image of the pods that run the workers' engine (the worker pools; in Ray mode every Ray
     node and the ray-up client): with engine.backend vllm, docker/Dockerfile.vllm's. */}}
{{- define "pdserve.workerImage" -}}
{{- if eq .Values.engine.backend "vllm" -}}
{{- $image := .Values.engine.vllm.image -}}
{{- printf "%s:%s" (default .Values.image.repository $image.repository) (default (printf "%s-vllm" .Chart.AppVersion) $image.tag) -}}
{{- else -}}
{{- include "pdserve.image" . -}}
{{- end -}}
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "role" "prefill"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
pdserve.io/role: {{ .role }}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end -}}

{{/* Every pod of this release (router, workers, tests): what Redis and the workers admit. */}}
{{- define "pdserve.releasePeers" -}}
podSelector:
  matchLabels:
    app.kubernetes.io/instance: {{ .Release.Name }}
    app.kubernetes.io/part-of: pdserve
{{- end -}}

{{/* PDSERVE_REDIS for every component, and the password beside it (not in the URL: any
     character may be in it, nothing needs escaping). */}}
{{- define "pdserve.redisEnv" -}}
{{- if eq .Values.redis.mode "bundled" }}
- name: PDSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ default (printf "%s-redis" (include "pdserve.fullname" .)) .Values.redis.bundled.existingSecret }}
      key: password
- name: PDSERVE_REDIS
  value: {{ printf "redis://%s-redis:6379/0" (include "pdserve.fullname" .) | quote }}
{{- else if .Values.redis.external.existingSecret.name }}
- name: PDSERVE_REDIS
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret.name }}
      key: {{ .Values.redis.external.existingSecret.key }}
{{- else }}
- name: PDSERVE_REDIS
  value: {{ required "redis.external.url or redis.external.existingSecret.name is required with redis.mode=external" .Values.redis.external.url | quote }}
{{- end }}
- name: PDSERVE_REDIS_NAMESPACE
  value: {{ .Values.redis.keyPrefix | quote }}
- name: PDSERVE_LAST_KNOWN_WORKERS  # read after a restart while Redis is down
  value: /var/lib/pdserve/workers.json
{{- end -}}

{{/* What every pdserve container needs: the model, the KV layout, a writable /tmp. */}}
{{- define "pdserve.commonEnv" -}}
- name: PDSERVE_MODEL
  value: {{ .Values.model.path | quote }}
- name: PDSERVE_DTYPE
  value: {{ .Values.model.dtype | quote }}
- name: PDSERVE_BLOCK_SIZE
  value: {{ .Values.blockSize | quote }}
- name: PDSERVE_KV_CACHE_DTYPE
  value: {{ .Values.kvCacheDtype | quote }}
- name: PDSERVE_ENGINE
  value: {{ .Values.engine.backend | quote }}
- name: PDSERVE_HOST
  value: "0.0.0.0"
- name: PDSERVE_ADVERTISE_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: PDSERVE_LOG_LEVEL
  value: INFO
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /tmp/hf
- name: TRITON_CACHE_DIR
  value: /tmp/triton
{{- if and .Values.tls.enabled (not .Values.ray.enabled) }}
- name: PDSERVE_TLS_CERT
  value: {{ printf "%s/tls.crt" .Values.tls.mountPath | quote }}
- name: PDSERVE_TLS_KEY
  value: {{ printf "%s/tls.key" .Values.tls.mountPath | quote }}
- name: PDSERVE_TLS_CA
  value: {{ printf "%s/ca.crt" .Values.tls.mountPath | quote }}
- name: PDSERVE_TLS_SERVER_NAME
  value: {{ .Values.tls.serverName | quote }}
{{- else }}
- name: PDSERVE_INSECURE  # plaintext between pods: tls.enabled=false (see NOTES)
  value: "true"
{{- end }}
{{- if and .Values.peerToken.enabled (not .Values.ray.enabled) }}
- name: PDSERVE_PEER_TOKEN  # pdserve/common/peer_token.py
  valueFrom:
    secretKeyRef:
      name: {{ printf "%s-peer-token" (include "pdserve.fullname" .) }}
      key: token
{{- end }}
{{- with .Values.tracing.otlpEndpoint }}
- name: PDSERVE_OTLP_ENDPOINT  # request traces (docs/observability.md)
  value: {{ . | quote }}
- name: PDSERVE_TRACE_SAMPLE_RATIO
  value: {{ $.Values.tracing.sampleRatio | quote }}
{{- end }}
{{ include "pdserve.redisEnv" . }}
{{- end -}}

{{- define "pdserve.tlsSecretName" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* Readiness: gRPC health; with TLS (kubelet's gRPC probe speaks no TLS) the same health on
     the metrics port's /healthz. (dict "root" $ "port" <grpc port>) */}}
{{- define "pdserve.readinessProbe" -}}
readinessProbe:
{{- if .root.Values.tls.enabled }}
  httpGet:
    path: /healthz
    port: metrics
{{- else }}
  grpc:
    port: {{ .port }}
{{- end }}
  periodSeconds: 5
  failureThreshold: 2
{{- end -}}

{{- define "pdserve.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else if .Values.model.download.claimName }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.download.claimName }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.download.sizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
- name: state
  emptyDir:
    sizeLimit: 16Mi
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "pdserve.tlsSecretName" . }}
{{- end }}
{{- end -}}

{{/* A serving container's mounts: the model read-only whatever its source (only the
     download init container writes it), /tmp, the last-known workers (pdserve/cluster/
     last_known.py: an emptyDir outlives a container restart), the TLS secret. */}}
{{- define "pdserve.volumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
- name: tmp
  mountPath: /tmp
- name: state
  mountPath: /var/lib/pdserve
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* With source: download, fetch the weights before the server starts (idempotent: the Hub
     client skips files already present, so pods sharing a claim download once). The pod's own
     image: (dict "root" $ "image" <image>). */}}
{{- define "pdserve.initContainers" -}}
{{- $image := .image -}}
{{- with .root -}}
{{- if eq .Values.model.source "download" }}
initContainers:
  - name: download-model
    image: {{ $image }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: [hf, download]
    args:
      - {{ required "model.download.modelId is required with model.source=download" .Values.model.download.modelId | quote }}
      - --revision
      - {{ .Values.model.download.revision | quote }}
      - --local-dir
      - {{ .Values.model.path | quote }}
    env:
      - name: HOME
        value: /tmp
      - name: HF_HOME
        value: /tmp/hf
      {{- if .Values.model.download.tokenSecret.name }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ .Values.model.download.tokenSecret.name }}
            key: {{ .Values.model.download.tokenSecret.key }}
      {{- end }}
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: model  # the one writer of the model volume
        mountPath: {{ .Values.model.mountPath }}
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end }}
{{- end -}}

{{/* Ray token auth for a Ray node or client (Ray mode): the token from the release's Secret. */}}
{{- define "pdserve.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.ray.auth.existingSecret | default (printf "%s-ray-auth" (include "pdserve.fullname" .)) }}
      key: auth_token
{{- end }}

{{/* Speculative decoding of a decode pool, as PDSERVE_* flags (nothing when method is null). */}}
{{- define "pdserve.speculativeEnv" -}}
{{- if and . .method }}
- name: PDSERVE_SPECULATIVE_METHOD
  value: {{ .method | quote }}
- name: PDSERVE_NUM_SPECULATIVE_TOKENS
  value: {{ .numSpeculativeTokens | quote }}
- name: PDSERVE_SPEC_NGRAM_MIN
  value: {{ .ngramMin | quote }}
- name: PDSERVE_SPEC_NGRAM_MAX
  value: {{ .ngramMax | quote }}
- name: PDSERVE_SPEC_MAX_BATCH_SIZE
  value: {{ .maxBatchSize | quote }}
- name: PDSERVE_SPEC_MIN_ACCEPTANCE
  value: {{ .minAcceptance | quote }}
{{- with .draftModel }}
- name: PDSERVE_SPEC_DRAFT_MODEL
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The same, as `pdserve ray up` flags. */}}
{{- define "pdserve.speculativeArgs" -}}
{{- if and . .method }}
- --speculative-method
- {{ .method | quote }}
- --num-speculative-tokens
- {{ .numSpeculativeTokens | quote }}
- --spec-ngram-min
- {{ .ngramMin | quote }}
- --spec-ngram-max
- {{ .ngramMax | quote }}
- --spec-max-batch-size
- {{ .maxBatchSize | quote }}
- --spec-min-acceptance
- {{ .minAcceptance | quote }}
{{- with .draftModel }}
- --spec-draft-model
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The vLLM engine's own options, as PDSERVE_* flags: with engine.backend vllm only (the
     native engine refuses them). */}}
{{- define "pdserve.vllmEnv" -}}
{{- $vllm := .Values.engine.vllm -}}
- name: PDSERVE_TENSOR_PARALLEL_SIZE
  value: {{ $vllm.tensorParallelSize | quote }}
{{- with $vllm.gpuMemoryUtilization }}
- name: PDSERVE_GPU_MEMORY_UTILIZATION
  value: {{ . | quote }}
{{- end }}
{{- with $vllm.quantization }}
- name: PDSERVE_QUANTIZATION
  value: {{ . | quote }}
{{- end }}
{{- if $vllm.enforceEager }}
- name: PDSERVE_ENFORCE_EAGER
  value: "true"
{{- end }}
- name: PDSERVE_ENGINE_CORE
  value: {{ $vllm.engineCore | quote }}
{{- end }}

{{/*
The KV ports a prefill worker listens on: kvTransfer.port, and with vLLM tensor parallelism one
more per rank (rank r serves its shard on kvTransfer.port + r; docs/engines.md). Prints the
number of ports.
*/}}
{{- define "pdserve.kvPorts" -}}
{{- if eq .Values.engine.backend "vllm" -}}
{{- max 1 (int .Values.engine.vllm.tensorParallelSize) -}}
{{- else -}}
1
{{- end -}}
{{- end }}
