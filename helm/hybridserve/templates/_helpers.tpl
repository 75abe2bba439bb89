{{/* Names: a RayService's serve Service is <name>-serve-svc and must stay under 63 chars. */}}
{{- define "hybridserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "hybridserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "hybridserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "hybridserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "hybridserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The claim of a pvc://CLAIM/PATH model source, or "" for other sources. */}}
{{- define "hybridserve.modelClaim" -}}
{{- if hasPrefix "pvc://" .Values.model.source -}}
{{- .Values.model.source | trimPrefix "pvc://" | splitList "/" | first -}}
{{- end -}}
{{- end -}}

{{- define "hybridserve.batchStoreClaim" -}}
{{- default (printf "%s-batch-store" (include "hybridserve.fullname" .)) .Values.batchStore.existingClaim -}}
{{- end -}}

{{/* Whether the Files and Batch APIs' store is a volume (service mode only). */}}
{{- define "hybridserve.batchStoreOn" -}}
{{- if and .Values.batchStore.enabled (eq .Values.mode "service") }}true{{- end -}}
{{- end -}}

{{- define "hybridserve.modelCacheClaim" -}}
{{- default (printf "%s-model-cache" (include "hybridserve.fullname" .)) .Values.modelCache.existingClaim -}}
{{- end -}}

{{/* engine_kwargs in vLLM spelling: the named values, then engine.extraKwargs. */}}
{{- define "hybridserve.engineKwargs" -}}
{{- $engine := .Values.engine -}}
{{- $kwargs := dict "tensor_parallel_size" (int $engine.tensorParallelSize) "gpu_memory_utilization" $engine.gpuMemoryUtilization "enable_prefix_caching" $engine.enablePrefixCaching -}}
{{- if $engine.maxModelLen -}}
{{- $_ := set $kwargs "max_model_len" (int $engine.maxModelLen) -}}
{{- end -}}
{{- $offload := .Values.kvOffload -}}
{{- if $offload.sizeGiB -}}
{{- $_ := set $kwargs "kv_offloading_backend" "native" -}}
{{- $_ := set $kwargs "kv_offloading_size" $offload.sizeGiB -}}
{{- if $offload.disk.sizeGiB -}}
{{- $_ := set $kwargs "kv_offloading_dir" $offload.disk.mountPath -}}
{{- $_ := set $kwargs "kv_offloading_disk_size" $offload.disk.sizeGiB -}}
{{- end -}}
{{- end -}}
{{- if $engine.speculativeConfig -}}
{{- $_ := set $kwargs "speculative_config" $engine.speculativeConfig -}}
{{- end -}}
{{- if .Values.lora.dynamicLoraLoadingPath -}}
{{- $_ := set $kwargs "max_loras" (int .Values.lora.maxLoras) -}}
{{- $_ := set $kwargs "max_lora_rank" (int .Values.lora.maxLoraRank) -}}
{{- end -}}
{{- range $key, $value := $engine.extraKwargs -}}
{{- if hasKey $kwargs $key -}}
{{- fail (printf "engine.extraKwargs.%s: set it through its own engine value (tensorParallelSize, maxModelLen, gpuMemoryUtilization, enablePrefixCaching, speculativeConfig)" $key) -}}
{{- end -}}
{{- $_ := set $kwargs $key $value -}}
{{- end -}}
{{- toYaml $kwargs -}}
{{- end -}}

{{/* The model deployment's autoscaling_config (Serve's names) from the autoscaling values. */}}
{{- define "hybridserve.autoscalingConfig" -}}
{{- $values := .Values.autoscaling -}}
{{- $config := dict "min_replicas" (int $values.minReplicas) "max_replicas" (int $values.maxReplicas) "target_ongoing_requests" $values.targetOngoingRequests "upscale_delay_s" $values.upscaleDelayS "downscale_delay_s" $values.downscaleDelayS "look_back_period_s" $values.lookBackPeriodS -}}
{{- if not (kindIs "invalid" $values.initialReplicas) -}}
{{- $_ := set $config "initial_replicas" (int $values.initialReplicas) -}}
{{- end -}}
{{- $hybrid := $values.hybridPolicy -}}
{{- if $hybrid.enabled -}}
{{- $kwargs := dict "metrics" $hybrid.metrics "target_kv_pressure" $hybrid.targetKvPressure "target_queue_len" $hybrid.targetQueueLen "target_ttft_s" $hybrid.targetTtftS -}}
{{- $_ := set $config "policy" (dict "policy_function" "cluster.serve.autoscaling_policy:hybrid_autoscaling_policy" "policy_kwargs" $kwargs) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* One LLMConfig (cluster.config.LLMConfig field names) as YAML. */}}
{{- define "hybridserve.llmConfig" -}}
{{- $serve := .Values.serve -}}
{{- $deployment := dict "max_ongoing_requests" (int $serve.maxOngoingRequests) "graceful_shutdown_timeout_s" $serve.gracefulShutdownTimeoutS -}}
{{- if .Values.autoscaling.enabled -}}
{{- $_ := set $deployment "autoscaling_config" (include "hybridserve.autoscalingConfig" . | fromYaml) -}}
{{- else -}}
{{- $_ := set $deployment "num_replicas" (int .Values.autoscaling.minReplicas) -}}
{{- end -}}
{{- with $serve.requestRouter.class -}}
{{- $_ := set $deployment "request_router_config" (dict "request_router_class" . "request_router_kwargs" $serve.requestRouter.kwargs) -}}
{{- end -}}
{{- $loading := dict "model_id" .Values.model.id "model_source" .Values.model.source -}}
{{- $config := dict "model_loading_config" $loading "engine_kwargs" (include "hybridserve.engineKwargs" . | fromYaml) "deployment_config" $deployment -}}
{{- with .Values.worker.acceleratorType -}}
{{- $_ := set $config "accelerator_type" . -}}
{{- end -}}
{{- with .Values.lora.dynamicLoraLoadingPath -}}
{{- $_ := set $config "lora_config" (dict "dynamic_lora_loading_path" . "max_num_adapters_per_replica" (int $.Values.lora.maxNumAdaptersPerReplica)) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Fail early on value combinations the schema cannot express. */}}
{{- define "hybridserve.checks" -}}
{{- $tp := int .Values.engine.tensorParallelSize -}}
{{- $gpus := mul (int .Values.worker.gpusPerPod) (int .Values.worker.maxReplicas) -}}
{{- if and (gt (int .Values.worker.gpusPerPod) 0) (gt $tp $gpus) -}}
{{- fail (printf "engine.tensorParallelSize=%d needs %d GPUs but worker.gpusPerPod x worker.maxReplicas gives %d" $tp $tp $gpus) -}}
{{- end -}}
{{- $autoscaling := .Values.autoscaling -}}
{{- if lt (int $autoscaling.maxReplicas) (int $autoscaling.minReplicas) -}}
{{- fail (printf "autoscaling.maxReplicas=%d is below autoscaling.minReplicas=%d" (int $autoscaling.maxReplicas) (int $autoscaling.minReplicas)) -}}
{{- end -}}
{{- with $autoscaling.initialReplicas -}}
{{- if or (lt (int .) (int $autoscaling.minReplicas)) (gt (int .) (int $autoscaling.maxReplicas)) -}}
{{- fail (printf "autoscaling.initialReplicas=%d is outside autoscaling.minReplicas=%d .. autoscaling.maxReplicas=%d" (int .) (int $autoscaling.minReplicas) (int $autoscaling.maxReplicas)) -}}
{{- end -}}
{{- end -}}
{{- if lt (int .Values.worker.maxReplicas) (int .Values.worker.minReplicas) -}}
{{- fail (printf "worker.maxReplicas=%d is below worker.minReplicas=%d" (int .Values.worker.maxReplicas) (int .Values.worker.minReplicas)) -}}
{{- end -}}
{{- end -}}

{{/* Environment of every Ray container. */}}
{{- define "hybridserve.env" -}}
{{- with .Values.model.hfToken.secretName }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ . | quote }}, key: {{ $.Values.model.hfToken.secretKey | quote }}}
{{- end }}
{{- with .Values.serve.apiKey.secretName }}
- name: HYBRIDSERVE_API_KEY
  valueFrom:
    secretKeyRef: {name: {{ . | quote }}, key: {{ $.Values.serve.apiKey.secretKey | quote }}}
{{- end }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: {{ ternary "1" "0" (eq (.Values.serve.ingress | default "haproxy") "haproxy") | quote }}
{{- if .Values.modelCache.enabled }}
- name: HF_HOME
  value: {{ .Values.modelCache.mountPath | quote }}
{{- end }}
{{- if include "hybridserve.batchStoreOn" . }}
- name: HYBRIDSERVE_BATCH_DIR
  value: {{ .Values.batchStore.mountPath | quote }}
{{- end }}
{{- end -}}

{{/* Volumes and mounts of every Ray pod: /dev/shm, the model cache, a pvc:// model, batch data. */}}
{{- define "hybridserve.volumes" -}}
- name: dshm
  emptyDir: {medium: Memory, sizeLimit: {{ .Values.shm.sizeLimit | quote }}}
{{- if .Values.modelCache.enabled }}
- name: model-cache
  persistentVolumeClaim: {claimName: {{ include "hybridserve.modelCacheClaim" . | quote }}}
{{- end }}
{{- with include "hybridserve.modelClaim" . }}
- name: model
  persistentVolumeClaim: {claimName: {{ . | quote }}, readOnly: true}
{{- end }}
{{- if and (eq .Values.mode "batch") .Values.batch.dataVolume.claimName }}
- name: batch-data
  persistentVolumeClaim: {claimName: {{ .Values.batch.dataVolume.claimName | quote }}}
{{- end }}
{{- if include "hybridserve.batchStoreOn" . }}
- name: batch-store
  persistentVolumeClaim: {claimName: {{ include "hybridserve.batchStoreClaim" . | quote }}}
{{- end }}
{{- if and .Values.kvOffload.sizeGiB .Values.kvOffload.disk.sizeGiB }}
- name: kv-offload
{{- with .Values.kvOffload.disk.hostPath }}
  hostPath: {path: {{ . | quote }}, type: DirectoryOrCreate}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- end -}}

{{- define "hybridserve.volumeMounts" -}}
- {name: dshm, mountPath: /dev/shm}
{{- if .Values.modelCache.enabled }}
- {name: model-cache, mountPath: {{ .Values.modelCache.mountPath | quote }}}
{{- end }}
{{- with include "hybridserve.modelClaim" . }}
- {name: model, mountPath: {{ printf "/mnt/pvc/%s" . | quote }}, readOnly: true}
{{- end }}
{{- if and (eq .Values.mode "batch") .Values.batch.dataVolume.claimName }}
- {name: batch-data, mountPath: {{ .Values.batch.dataVolume.mountPath | quote }}}
{{- end }}
{{- if include "hybridserve.batchStoreOn" . }}
- {name: batch-store, mountPath: {{ .Values.batchStore.mountPath | quote }}}
{{- end }}
{{- if and .Values.kvOffload.sizeGiB .Values.kvOffload.disk.sizeGiB }}
- {name: kv-offload, mountPath: {{ .Values.kvOffload.disk.mountPath | quote }}}
{{- end }}
{{- end -}}

{{- define "hybridserve.ports" -}}
- {name: serve, containerPort: {{ int .Values.serve.httpPort }}}
- {name: metrics, containerPort: {{ int .Values.metrics.port }}}
{{- if .Values.serve.grpc.enabled }}
- {name: grpc, containerPort: {{ int .Values.serve.grpc.port }}}
{{- end }}
{{- end -}}

{{/* Worker container resources: worker.resources plus worker.cpus and the GPUs. */}}
{{- define "hybridserve.workerResources" -}}
{{- $resources := deepCopy .Values.worker.resources -}}
{{- $requests := default (dict) (get $resources "requests") -}}
{{- $limits := default (dict) (get $resources "limits") -}}
{{- $_ := set $requests "cpu" (toString .Values.worker.cpus) -}}
{{- if gt (int .Values.worker.gpusPerPod) 0 -}}
{{- $_ := set $requests .Values.worker.gpuResourceName (toString .Values.worker.gpusPerPod) -}}
{{- $_ := set $limits .Values.worker.gpuResourceName (toString .Values.worker.gpusPerPod) -}}
{{- end -}}
{{- $_ := set $resources "requests" $requests -}}
{{- if $limits -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/* The pod template of the head (.role = "head") or of a worker (.role = "worker"). */}}
{{- define "hybridserve.podTemplate" -}}
{{- $root := .root -}}
{{- $values := index $root.Values .role -}}
metadata:
  labels:
    {{- include "hybridserve.labels" $root | nindent 4 }}
spec:
  terminationGracePeriodSeconds: {{ add (int $root.Values.serve.gracefulShutdownTimeoutS) 30 }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
  - name: {{ printf "ray-%s" .role }}
    image: {{ include "hybridserve.image" $root | quote }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    {{- /* The chart's variables first, so that an entry of head.env / worker.env overrides them. */}}
    {{- $env := concat (include "hybridserve.env" $root | fromYamlArray) ($values.env | default list) }}
    {{- with $env }}
    env:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    ports:
      {{- if eq .role "head" }}
      - {name: gcs-server, containerPort: 6379}
      - {name: dashboard, containerPort: 8265}
      - {name: client, containerPort: 10001}
      {{- end }}
      {{- include "hybridserve.ports" $root | nindent 6 }}
    resources:
      {{- if eq .role "head" }}
      {{- toYaml $values.resources | nindent 6 }}
      {{- else }}
      {{- include "hybridserve.workerResources" $root | nindent 6 }}
      {{- end }}
    volumeMounts:
      {{- include "hybridserve.volumeMounts" $root | nindent 6 }}
      {{- with .extraMounts }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
  volumes:
    {{- include "hybridserve.volumes" $root | nindent 4 }}
    {{- with .extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* The RayCluster spec shared by the RayService and the RayJob. */}}
{{- define "hybridserve.rayClusterSpec" -}}
{{- $root := .root -}}
{{- $worker := $root.Values.worker -}}
rayVersion: {{ $root.Values.rayVersion | quote }}
enableInTreeAutoscaling: {{ gt (int $worker.maxReplicas) (int $worker.minReplicas) }}
headGroupSpec:
  rayStartParams:
    {{- toYaml $root.Values.head.rayStartParams | nindent 4 }}
  template:
    {{- include "hybridserve.podTemplate" (dict "root" $root "role" "head" "extraMounts" .headMounts "extraVolumes" .headVolumes) | nindent 4 }}
workerGroupSpecs:
- groupName: {{ $worker.groupName }}
  replicas: {{ int $worker.replicas }}
  minReplicas: {{ int $worker.minReplicas }}
  maxReplicas: {{ int $worker.maxReplicas }}
  rayStartParams:
    {{- $params := merge (deepCopy $worker.rayStartParams) (dict "num-cpus" (toString $worker.cpus) "num-gpus" (toString $worker.gpusPerPod)) }}
    {{- toYaml $params | nindent 4 }}
  template:
    {{- include "hybridserve.podTemplate" (dict "root" $root "role" "worker") | nindent 4 }}
{{- end -}}
