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
