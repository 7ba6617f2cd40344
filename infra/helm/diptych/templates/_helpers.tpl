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
