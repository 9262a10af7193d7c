{{/* One worker pool's Deployment: (dict "root" $ "role" "prefill"|"decode"). Both pools are
     rendered from here, so they differ only in their values and role-specific flags. */}}
{{- define "pdserve.workerDeployment" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $pool := index $root.Values $role -}}
{{- $ctx := dict "root" $root "role" $role -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pdserve.fullname" $root }}-{{ $role }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  {{- if not (or $pool.autoscaling.enabled $pool.keda.enabled $root.Values.planner.enabled) }}
  replicas: {{ $pool.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0  # a replacement serves before an old worker drains
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" $ctx | nindent 8 }}
    spec:
      serviceAccountName: {{ include "pdserve.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ $pool.terminationGracePeriodSeconds }}
      {{- $image := include "pdserve.workerImage" $root }}
      {{- include "pdserve.initContainers" (dict "root" $root "image" $image) | nindent 6 }}
      containers:
        - name: {{ $role }}
          image: {{ $image }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            - {{ $role }}
            {{- range $pool.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "pdserve.commonEnv" $root | nindent 12 }}
            - name: PDSERVE_WORKER_ID  # the pod name: `pdserve drain <pod>` finds it
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: PDSERVE_PORT
              value: {{ $pool.port | quote }}
            - name: PDSERVE_METRICS_PORT
              value: {{ $pool.metricsPort | quote }}
            - name: PDSERVE_DRAIN_TIMEOUT_S
              value: {{ $pool.drainTimeoutSeconds | quote }}
            - name: PDSERVE_KV_BACKEND
              value: {{ $root.Values.kvTransfer.backend | quote }}
            - name: PDSERVE_MAX_NUM_SEQS
              value: {{ $pool.engine.maxNumSeqs | quote }}
            - name: PDSERVE_MAX_NUM_BATCHED_TOKENS
              value: {{ $pool.engine.maxNumBatchedTokens | quote }}
            {{- with $pool.engine.numBlocks }}
            - name: PDSERVE_NUM_BLOCKS
              value: {{ . | quote }}
            {{- end }}
            {{- with $pool.engine.maxModelLen }}
            - name: PDSERVE_MAX_MODEL_LEN
              value: {{ . | quote }}
            {{- end }}
            {{- with $pool.engine.hostCacheGib }}
            - name: PDSERVE_HOST_CACHE_GIB
              value: {{ . | quote }}
            {{- end }}
            {{- if eq $root.Values.engine.backend "vllm" }}
            {{- include "pdserve.vllmEnv" $root | nindent 12 }}
            {{- end }}
            {{- if eq $root.Values.kvTransfer.backend "nixl" }}
            {{- $nixl := $root.Values.kvTransfer.nixl }}
            {{- with $nixl.ucxTls }}
            - name: PDSERVE_UCX_TLS
              value: {{ . | quote }}
            {{- end }}
            - name: PDSERVE_KV_VERIFY
              value: {{ ternary "on" "off" $nixl.verify | quote }}
            - name: UCX_TCP_PORT_RANGE  # read by UCX itself: the ports the NetworkPolicy opens
              value: {{ $nixl.tcpPortRange | quote }}
            {{- end }}
            {{- if eq $role "prefill" }}
            - name: PDSERVE_KV_PORT
              value: {{ $root.Values.kvTransfer.port | quote }}
            - name: PDSERVE_LEASE_S
              value: {{ $root.Values.kvTransfer.leaseSeconds | quote }}
            - name: PDSERVE_KV_STORE_REPLICAS
              value: {{ $root.Values.kvstore.prefixCopies | quote }}
            {{- else }}
            - name: PDSERVE_TRANSFER_TIMEOUT_S
              value: {{ $root.Values.kvTransfer.timeoutSeconds | quote }}
            {{- include "pdserve.speculativeEnv" $pool.speculative | nindent 12 }}
            {{- end }}
            {{- with $pool.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $pool.port }}
            - name: metrics
              containerPort: {{ $pool.metricsPort }}
            {{- if eq $role "prefill" }}
            - name: kv
              containerPort: {{ $root.Values.kvTransfer.port }}
            {{- /* vLLM tensor parallelism: rank r serves its KV shard on port + r. */}}
            {{- range $rank := untilStep 1 (int (include "pdserve.kvPorts" $root)) 1 }}
            - name: kv-rank-{{ $rank }}
              containerPort: {{ add $root.Values.kvTransfer.port $rank }}
            {{- end }}
            {{- end }}
          # The server listens at once and reports NOT_SERVING until the model is loaded, and
          # again while draining: readiness follows health, liveness only needs the socket.
          startupProbe:
            tcpSocket:
              port: grpc
            periodSeconds: 5
            failureThreshold: 60
          {{- include "pdserve.readinessProbe" (dict "root" $root "port" $pool.port) | nindent 10 }}
          # Progress, not a TCP check: /livez fails once the engine has had work and completed
          # no step for --liveness-stall-s (a hung device sync); the process still answers.
          livenessProbe:
            httpGet:
              path: /livez
              port: metrics
            periodSeconds: 10
            failureThreshold: 6
          lifecycle:
            preStop:
              exec:
                # Mark the worker draining in the registry (the router sends it nothing new),
                # then wait while it finishes in-flight work (and, on prefill, leased KV) and
                # exits. If Redis is unreachable, SIGTERM starts the same drain.
                command:
                  - /bin/sh
                  - -c
                  - pdserve drain "$PDSERVE_WORKER_ID" && while kill -0 1 2>/dev/null; do sleep 1; done; true
          {{- $resources := deepCopy $pool.resources }}
          {{- $nixl := eq $root.Values.kvTransfer.backend "nixl" }}
          {{- if and $nixl $root.Values.kvTransfer.nixl.rdmaResources }}
          {{- $limits := merge (deepCopy (default (dict) $resources.limits)) $root.Values.kvTransfer.nixl.rdmaResources }}
          {{- $_ := set $resources "limits" $limits }}
          {{- end }}
          {{- $tp := int $root.Values.engine.vllm.tensorParallelSize }}
          {{- if and (eq $root.Values.engine.backend "vllm") (gt $tp 1) }}
          {{- /* vLLM shards the model over tensorParallelSize GPUs: at least that many. */}}
          {{- range $kind := list "requests" "limits" }}
          {{- $amounts := index $resources $kind }}
          {{- if and $amounts (hasKey $amounts "nvidia.com/gpu") }}
          {{- $_ := set $amounts "nvidia.com/gpu" (max (int (index $amounts "nvidia.com/gpu")) $tp) }}
          {{- end }}
          {{- end }}
          {{- end }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            {{- include "pdserve.volumeMounts" $root | nindent 12 }}
            {{- if $nixl }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
      volumes:
        {{- include "pdserve.modelVolume" $root | nindent 8 }}
        {{- if $nixl }}
        - name: dshm  # UCX's shared-memory transports
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.kvTransfer.nixl.shmSizeLimit }}
        {{- end }}
      {{- with $pool.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
