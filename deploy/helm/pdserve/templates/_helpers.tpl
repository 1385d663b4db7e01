{{/*
Names, labels and the pieces every pdserve pod shares. Addresses between pods are fully
qualified (<name>.<namespace>.svc.<clusterDomain>), so they resolve whatever a pod's DNS search
path is.
*/}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-pdserve, or the release name when it already contains the chart's name. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels; call with (dict "ctx" $ "component" "router"). */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" .ctx }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{/* The labels selectors use: never the role label, which changes at run time. */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdserve.dnsSuffix" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* host:port of a Service of this release: (dict "ctx" $ "svc" "router-control" "port" 50051). */}}
{{- define "pdserve.serviceAddress" -}}
{{- printf "%s-%s.%s:%v" (include "pdserve.fullname" .ctx) .svc (include "pdserve.dnsSuffix" .ctx) .port }}
{{- end }}

{{- define "pdserve.masterReplicas" -}}
{{- if .Values.store.ha.enabled }}{{ .Values.store.ha.replicas }}{{ else }}1{{ end }}
{{- end }}

{{/* Every store master, comma-separated: each pod by its stable name (clients follow the
leader among them). */}}
{{- define "pdserve.masterAddresses" -}}
{{- $full := include "pdserve.fullname" . }}
{{- $suffix := include "pdserve.dnsSuffix" . }}
{{- $out := list }}
{{- range $i := until (int (include "pdserve.masterReplicas" .)) }}
{{- $out = append $out (printf "%s-master-%d.%s-master.%s:%v" $full $i $full $suffix $.Values.store.master.port) }}
{{- end }}
{{- join "," $out }}
{{- end }}

{{/* The router-control Service (the control listener, TLS, of any one router): where the
controller's label sync calls. */}}
{{- define "pdserve.routerControlAddress" -}}
{{- include "pdserve.serviceAddress" (dict "ctx" . "svc" "router-control" "port" .Values.router.controlPort) }}
{{- end }}

{{- define "pdserve.redisUrl" -}}
{{- if .Values.store.ha.redis.url }}
{{- .Values.store.ha.redis.url }}
{{- else }}
{{- printf "redis://%s-redis.%s:6379/0" (include "pdserve.fullname" .) (include "pdserve.dnsSuffix" .) }}
{{- end }}
{{- end }}

{{/*
The start of a router or worker container: /bin/sh runs this, then execs the pdserve command
given as the container's args with the model appended (MODEL_PATH, or the image's default
model). A worker also gets its role: the pod's pdserve.io/role label if it has one (kept across
container restarts, after the controller moved it), else from its ordinal (below
INITIAL_PREFILL_WORKERS: prefill), exported as PDSERVE_WORKER_ROLE (the --role flag).
Call with (dict "role" true) for a worker.
*/}}
{{- define "pdserve.launchScript" -}}
set -eu
if [ -z "${MODEL_PATH:-}" ]; then
  MODEL_PATH="$(python -c 'from pdserve.engine.loader import default_model_path as p; print(p())')"
fi
{{- if .role }}
role=""
if [ -n "${ROLE_LABEL_FILE:-}" ] && [ -r "$ROLE_LABEL_FILE" ]; then
  role="$(sed -n 's/^pdserve\.io\/role="\([a-z]*\)"$/\1/p' "$ROLE_LABEL_FILE")"
fi
case "$role" in
  prefill|decode) ;;
  *) if [ "${POD_NAME##*-}" -lt "$INITIAL_PREFILL_WORKERS" ]; then role=prefill; else role=decode; fi ;;
esac
export PDSERVE_WORKER_ROLE="$role"
echo "pdserve-launch: $POD_NAME starts as $role" >&2
{{- end }}
exec "$@" --model "$MODEL_PATH"
{{- end }}

{{/* A probe: (dict "probe" {"grpc": ...} "timing" .Values.x.startupProbe). */}}
{{- define "pdserve.probe" -}}
{{- toYaml (merge (deepCopy .timing) .probe) }}
{{- end }}

{{- define "pdserve.downwardEnv" -}}
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
{{- end }}

{{- define "pdserve.modelEnv" -}}
{{- if .Values.model.path }}
- name: MODEL_PATH
  value: {{ .Values.model.path | quote }}
{{- end }}
{{- end }}

{{- define "pdserve.modelVolumeMount" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "pdserve.modelVolume" -}}
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end }}

{{/* Scheduling and pod-level settings: (dict "ctx" $ "v" .Values.router). */}}
{{- define "pdserve.podScheduling" -}}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .ctx.Values.podSecurityContext }}
securityContext:
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

{{- define "pdserve.clusterIdArgs" -}}
{{- if .Values.clusterId }}
- --cluster-id
- {{ .Values.clusterId | quote }}
{{- end }}
{{- end }}

{{- define "pdserve.controllerServiceAccount" -}}
{{- if .Values.controller.serviceAccount.create }}
{{- default (printf "%s-controller" (include "pdserve.fullname" .)) .Values.controller.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.controller.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdserve.controllerEnabled" -}}
{{- if and .Values.controller.enabled (not .Values.staticMode) }}true{{ end }}
{{- end }}

{{/*
Internal TLS. Each pod mounts ONLY its own kind's certificate and key, plus the CA's
certificate, read-only at one fixed path (tls.mountPath below), and gets --tls-dir that path;
the CA's key is never in a pod. Kinds: router, worker, node, master, controller.
*/}}
{{- define "pdserve.tlsMountPath" -}}/etc/pdserve/tls{{- end }}

{{/* The Secret an operator makes (tls.certManager off): tls.secretName, else <fullname>-tls. */}}
{{- define "pdserve.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "pdserve.fullname" .)) .Values.tls.secretName }}
{{- end }}

{{/* The Secret cert-manager writes a kind's certificate into: (dict "ctx" $ "kind" "router"). */}}
{{- define "pdserve.certSecretName" -}}
{{- printf "%s-%s-tls" (include "pdserve.fullname" .ctx) .kind }}
{{- end }}

{{/* --tls-dir, or --insecure-internal when tls.enabled is false (plaintext). */}}
{{- define "pdserve.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-dir
- {{ include "pdserve.tlsMountPath" . }}
{{- else }}
- --insecure-internal
{{- end }}
{{- end }}

{{- define "pdserve.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "pdserve.tlsMountPath" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The kind's files only, by a Secret `items` projection: (dict "ctx" $ "kind" "router").
Mode 0440 (288): readable by the pod's fsGroup, the process's group. */}}
{{- define "pdserve.tlsVolume" -}}
{{- $ctx := .ctx }}
{{- if $ctx.Values.tls.enabled }}
- name: tls
  secret:
    {{- if $ctx.Values.tls.certManager.enabled }}
    # cert-manager's Secret of this kind: tls.crt/tls.key/ca.crt as the TLS folder's names.
    secretName: {{ include "pdserve.certSecretName" . }}
    defaultMode: 288
    items:
      - key: ca.crt
        path: ca.crt
      - key: tls.crt
        path: {{ .kind }}.crt
      - key: tls.key
        path: {{ .kind }}.key
    {{- else }}
    secretName: {{ include "pdserve.tlsSecretName" $ctx }}
    defaultMode: 288
    items:
      - key: ca.crt
        path: ca.crt
      - key: {{ .kind }}.crt
        path: {{ .kind }}.crt
      - key: {{ .kind }}.key
        path: {{ .kind }}.key
    {{- end }}
{{- end }}
{{- end }}

{{/*
A read-only root filesystem: every pdserve container writes only to emptyDirs, /tmp (TMPDIR:
Python's and torch's temporary files) and HOME (~/.cache/pdserve, the compiled CPU kernels
unless PDSERVE_CACHE says otherwise; Triton's ~/.triton; matplotlib's ~/.config).
*/}}
{{- define "pdserve.writableEnv" -}}
- name: HOME
  value: /home/pdserve
- name: TMPDIR
  value: /tmp
{{- end }}

{{- define "pdserve.writableMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/pdserve
{{- end }}

{{- define "pdserve.writableVolumes" -}}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
{{- end }}

{{/* The admin keys (adminKeysSecret, key `admin-keys`): the router's and the controller's. */}}
{{- define "pdserve.adminKeysArgs" -}}
{{- if .Values.adminKeysSecret }}
- --admin-keys-file
- /etc/pdserve/admin-keys/admin-keys
{{- end }}
{{- end }}

{{- define "pdserve.adminKeysMount" -}}
{{- if .Values.adminKeysSecret }}
- name: admin-keys
  mountPath: /etc/pdserve/admin-keys
  readOnly: true
{{- end }}
{{- end }}

{{- define "pdserve.adminKeysVolume" -}}
{{- if .Values.adminKeysSecret }}
- name: admin-keys
  secret:
    secretName: {{ .Values.adminKeysSecret }}
    defaultMode: 288
    items:
      - key: admin-keys
        path: admin-keys
{{- end }}
{{- end }}

{{/* A container's securityContext (securityContext), when not empty. */}}
{{- define "pdserve.containerSecurity" -}}
{{- with .Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The selector of one component's pods of this release, as a NetworkPolicy peer. */}}
{{- define "pdserve.peer" -}}
- podSelector:
    matchLabels:
      {{- include "pdserve.selectorLabels" . | nindent 6 }}
{{- end }}
