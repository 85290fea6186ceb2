{{/* Names and labels. */}}
{{- define "runfeed.fullname" -}}
{{- printf "%s-runfeed" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "runfeed.selectorLabels" -}}
app.kubernetes.io/name: runfeed
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "runfeed.labels" -}}
{{ include "runfeed.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
