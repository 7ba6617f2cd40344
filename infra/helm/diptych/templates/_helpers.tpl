{{/* Labels every object carries. */}}
{{- define "diptych.labels" -}}
app.kubernetes.io/name: diptych
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The labels that select one component's pods: (list $ "component"). */}}
{{- define "diptych.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: diptych
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* The image of a component: (list $ "cpu") or (list $ "gpu"). Tags are pinned: `latest` is refused. */}}
{{- define "diptych.image" -}}
{{- $root := index . 0 -}}
{{- $tag := ternary $root.Values.image.cudaTag $root.Values.image.tag (eq (index . 1) "gpu") -}}
{{- if or (not $tag) (eq $tag "latest") (hasSuffix ":latest" $tag) -}}
{{- fail "image.tag and image.cudaTag must pin a version (not empty, not `latest`)" -}}
{{- end -}}
{{- printf "%s:%s" $root.Values.image.repository $tag -}}
{{- end -}}

{{/* The control plane's in-cluster URL, which the gateway, workers and KV tier report to. */}}
{{- define "diptych.controlPlaneUrl" -}}
{{- printf "http://%s-control-plane:8000" .Release.Name -}}
{{- end -}}

{{/* A required value, failing with its name: (list $value "secrets.databaseUrl"). */}}
{{- define "diptych.required" -}}
{{- required (printf "set %s (see values.yaml)" (index . 1)) (index . 0) -}}
{{- end -}}

{{/* Every pod runs as the image's user and group (uid and gid 10001, infra/Dockerfile), never as root, under the
runtime's seccomp profile; fsGroup lets that user write to the volumes it is given. */}}
{{- define "diptych.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* Every container: a read-only root filesystem, no privilege escalation, no capabilities. What a process
writes goes to the volumes of "diptych.writableVolumes" (and, for some, a state or cache volume of its own). */}}
{{- define "diptych.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* The writable directories every process needs on a read-only root filesystem: /tmp (gunicorn's heartbeat
files, torch's compile caches) and the image user's HOME (the caches libraries keep under ~/.cache). */}}
{{- define "diptych.writableMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: home, mountPath: /home/diptych}
{{- end -}}

{{- define "diptych.writableVolumes" -}}
- {name: tmp, emptyDir: {}}
- {name: home, emptyDir: {}}
{{- end -}}

{{/* A pod's own ServiceAccount, named as its workload: (list $ "diptych-gateway"). No pod talks to the Kubernetes
API, so none gets a token mounted (templates/service-accounts.yaml turns it off on the accounts as well). */}}
{{- define "diptych.podIdentity" -}}
serviceAccountName: {{ index . 1 }}
automountServiceAccountToken: false
{{- end -}}

{{/* A ServiceAccount for one workload's pods: (list $ "diptych-gateway"); serviceAccount.annotations go on each
(e.g. the cloud role that reads the artifact store). */}}
{{- define "diptych.serviceAccount" -}}
{{- $root := index . 0 -}}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ index . 1 }}
  labels: {{- include "diptych.labels" $root | nindent 4 }}
  {{- with $root.Values.serviceAccount.annotations }}
  annotations: {{- toYaml . | nindent 4 }}
  {{- end }}
automountServiceAccountToken: false
{{- end -}}

{{/* Replicas of a component on different nodes where the scheduler can (preferred, not required: a small
cluster still runs them all), so that one node going down takes at most one of them: (list $ "gateway"). */}}
{{- define "diptych.spreadOverNodes" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels: {{- include "diptych.selector" . | nindent 12 }}
{{- end -}}

{{/* Voluntary disruptions (node drains, upgrades) take one replica of a component at a time: (list $ "gateway").
maxUnavailable rather than minAvailable, so that a single replica does not block a drain for good. */}}
{{- define "diptych.disruptionBudget" -}}
{{- $root := index . 0 -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ printf "%s-%s" $root.Release.Name (index . 1) }}
  labels: {{- include "diptych.labels" $root | nindent 4 }}
spec:
  maxUnavailable: 1
  selector:
    matchLabels: {{- include "diptych.selector" . | nindent 6 }}
{{- end -}}
