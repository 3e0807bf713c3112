{{/* Names and labels. */}}
{{- define "corestream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Short enough that "<fullname>-coordinator" and engine pod names fit in 63 characters. */}}
{{- define "corestream.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "corestream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "corestream.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Call with (dict "root" $ "component" "frontend"); component "" labels release-wide objects. */}}
{{- define "corestream.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "corestream.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: corestream
{{- end -}}

{{- define "corestream.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "corestream.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Image of a component: (dict "root" $ "variant" "slim"|"cpu"|"cuda"). */}}
{{- define "corestream.image" -}}
{{- $image := .root.Values.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else if $image.tag -}}
{{- printf "%s:%s" $image.repository $image.tag -}}
{{- else -}}
{{- printf "%s:%s-%s" $image.repository .root.Chart.AppVersion .variant -}}
{{- end -}}
{{- end -}}

{{- define "corestream.engineVariant" -}}
{{- if gt (int .Values.engine.accelerator.count) 0 }}cuda{{ else }}cpu{{ end -}}
{{- end -}}

{{/* The termination block of a component: the top-level one with its overrides, as JSON. */}}
{{- define "corestream.termination" -}}
{{- $component := index .root.Values .component -}}
{{- merge (deepCopy (default dict $component.termination)) (deepCopy .root.Values.termination) | toJson -}}
{{- end -}}

{{- define "corestream.coordinatorHost" -}}
{{- printf "%s-coordinator.%s.svc.%s" (include "corestream.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "corestream.engineServiceName" -}}
{{- printf "%s-engine" (include "corestream.fullname" .) -}}
{{- end -}}

{{/* Port the kubelet's gRPC probes call: the plaintext health port while TLS is on. */}}
{{- define "corestream.probePort" -}}
{{- if .root.Values.security.tls.enabled -}}
{{- .root.Values.security.healthPort -}}
{{- else -}}
{{- .port -}}
{{- end -}}
{{- end -}}

{{/*
Native gRPC probes against the grpc.health.v1 service names every process serves:
"startup" (became ready once: the model is loaded), "readiness" (warm, not draining,
not overloaded), "liveness" (making progress; an engine whose watchdog fired fails it).
Call with (dict "root" $ "port" 50051 "probes" .Values.frontend.probes).
*/}}
{{- define "corestream.probes" -}}
{{- $port := include "corestream.probePort" . | int -}}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{ $kind }}Probe:
  grpc:
    port: {{ $port }}
    service: {{ $kind }}
  {{- toYaml (index $.probes $kind) | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Flags every service takes: address, logging, metrics, tracing, TLS. Internal services
bind to the pod IP only; the frontend binds to listenHost so that kubectl port-forward
(which connects to localhost inside the pod) reaches it too.
*/}}
{{- define "corestream.commonArgs" -}}
{{- $podIP := and .root.Values.bindPodIP (ne .component "frontend") -}}
- --host={{ ternary "$(POD_IP)" .root.Values.listenHost $podIP }}
- --log-level={{ .root.Values.logLevel }}
- --log-format={{ .root.Values.logFormat }}
{{- if .root.Values.metrics.enabled }}
- --metrics-port={{ int .root.Values.metrics.port }}
{{- end }}
{{- if .root.Values.tracing.enabled }}
- --otlp-endpoint={{ .root.Values.tracing.otlpEndpoint }}
- --trace-sample-ratio={{ .root.Values.tracing.sampleRatio }}
{{- end }}
{{- if .root.Values.security.tls.enabled }}
- --tls-cert=/etc/corestream/tls/tls.crt
- --tls-key=/etc/corestream/tls/tls.key
- --tls-ca=/etc/corestream/tls/ca.crt
- --health-port={{ int .root.Values.security.healthPort }}
{{- if .root.Values.bindPodIP }}
- --health-host=$(POD_IP)
{{- end }}
{{- if and (eq .component "frontend") (not .root.Values.security.tls.requireClientCertOnFrontend) }}
- --no-require-client-cert
{{- end }}
{{- end }}
{{- if not .root.Values.security.reflection }}
- --no-reflection
{{- end }}
{{- end -}}

{{- define "corestream.modelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.modelCache.mountPath) (trimPrefix "/" .Values.model.path) -}}
{{- end -}}

{{- define "corestream.modelClaim" -}}
{{- default (printf "%s-models" (include "corestream.fullname" .)) .Values.modelCache.existingClaim -}}
{{- end -}}

{{/* Environment of every service container. */}}
{{- define "corestream.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
# The read-only root filesystem leaves only the emptyDirs writable.
- name: CORESTREAM_CACHE_DIR
  value: /var/cache/corestream
- name: TORCH_EXTENSIONS_DIR
  value: /var/cache/corestream/torch_extensions
- name: TRITON_CACHE_DIR
  value: /var/cache/corestream/triton
- name: XDG_CACHE_HOME
  value: /var/cache/corestream/xdg
{{- if .root.Values.tracing.enabled }}
- name: OTEL_SERVICE_NAME
  value: corestream-{{ .component }}
{{- end }}
{{- with (index .root.Values .component).extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "corestream.ports" -}}
- name: grpc
  containerPort: {{ .port }}
  protocol: TCP
{{- if .root.Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .root.Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- if .root.Values.security.tls.enabled }}
- name: health
  containerPort: {{ .root.Values.security.healthPort }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/* Mounts of every service container; the model volume where a model is read. */}}
{{- define "corestream.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /var/cache/corestream
{{- if and .root.Values.model.path (ne .component "coordinator") }}
- name: models
  mountPath: {{ .root.Values.modelCache.mountPath }}
  readOnly: true
{{- end }}
{{- if .root.Values.security.tls.enabled }}
- name: tls
  mountPath: /etc/corestream/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "corestream.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
- name: cache
  emptyDir:
    sizeLimit: 10Gi
{{- if and .root.Values.model.path (ne .component "coordinator") }}
- name: models
  persistentVolumeClaim:
    claimName: {{ include "corestream.modelClaim" .root }}
    readOnly: true
{{- end }}
{{- if .root.Values.security.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .root.Values.security.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/*
Pod-level fields shared by every component: security, service account, scheduling and
termination. Call with (dict "root" $ "component" "engine").
*/}}
{{- define "corestream.podSpec" -}}
{{- $values := index .root.Values .component -}}
{{- $termination := include "corestream.termination" . | fromJson -}}
serviceAccountName: {{ include "corestream.serviceAccountName" .root }}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ $termination.gracePeriodSeconds }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The container fields shared by every component. */}}
{{- define "corestream.containerCommon" -}}
{{- $termination := include "corestream.termination" . | fromJson -}}
imagePullPolicy: {{ .root.Values.image.pullPolicy }}
securityContext:
  {{- toYaml .root.Values.containerSecurityContext | nindent 2 }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ $termination.preStopSleepSeconds }}
{{- end -}}

{{/* Pod annotations: the model revision rolls every pod when it changes. */}}
{{- define "corestream.podAnnotations" -}}
{{- $values := index .root.Values .component -}}
{{- if .root.Values.model.revision }}
corestream.io/model-revision: {{ .root.Values.model.revision | quote }}
{{- end }}
{{- with $values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
With a download Job, pods wait for the revision it wrote before serving; the marker
file is written last, so a half-written checkpoint is never loaded.
*/}}
{{- define "corestream.waitForModel" -}}
{{- if .root.Values.model.download.enabled }}
initContainers:
  - name: wait-for-model
    image: {{ include "corestream.image" (dict "root" .root "variant" .variant) }}
    imagePullPolicy: {{ .root.Values.image.pullPolicy }}
    command: [/bin/sh, -c]
    args:
      - |
        until [ "$$(cat {{ include "corestream.modelPath" .root }}/.corestream-revision 2>/dev/null)" = "$REVISION" ]; do
          echo "waiting for {{ .root.Values.model.download.repo }}@$REVISION in {{ include "corestream.modelPath" .root }}"
          sleep 10
        done
    env:
      - name: REVISION
        value: {{ .root.Values.model.revision | quote }}
    securityContext:
      {{- toYaml .root.Values.containerSecurityContext | nindent 6 }}
    resources:
      requests: {cpu: 10m, memory: 16Mi}
      limits: {memory: 64Mi}
    volumeMounts:
      - name: models
        mountPath: {{ .root.Values.modelCache.mountPath }}
        readOnly: true
{{- end }}
{{- end -}}
