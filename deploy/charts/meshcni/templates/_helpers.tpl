{{/*
Name of the chart (the app.kubernetes.io/name label).
*/}}
{{- define "meshcni.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Base name of the release's objects: the release name when it already holds the chart
name, else <release>-<chart>. Truncated so that "<fullname>-taint-controller" stays a
valid name.
*/}}
{{- define "meshcni.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
Labels of every object (Kubernetes recommended labels). Call with (dict "ctx" . "component" "agent").
*/}}
{{- define "meshcni.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "meshcni.selectorLabels" . }}
app.kubernetes.io/version: {{ include "meshcni.tag" .ctx | trunc 63 | quote }}
app.kubernetes.io/part-of: meshcni
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end -}}

{{/*
Selector labels of a component's pods. Call with (dict "ctx" . "component" "agent").
*/}}
{{- define "meshcni.selectorLabels" -}}
app.kubernetes.io/name: {{ include "meshcni.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
The agent pods' label selector as a string (the taint controller's --agent-selector).
*/}}
{{- define "meshcni.agentSelector" -}}
{{- printf "app.kubernetes.io/name=%s,app.kubernetes.io/instance=%s,app.kubernetes.io/component=agent" (include "meshcni.name" .) .Release.Name -}}
{{- end -}}

{{- define "meshcni.tag" -}}
{{- .Values.tag | default .Chart.AppVersion -}}
{{- end -}}

{{/*
The image: image when it is a reference (it holds a "/"), {hub}/{image} when it is a name
with a tag or digest, {hub}/{image}:{tag} for a bare name, else {hub}/meshcni:{tag}.
*/}}
{{- define "meshcni.image" -}}
{{- $img := .Values.image | default "" -}}
{{- $hub := .Values.hub | trimSuffix "/" -}}
{{- if contains "/" $img -}}
{{- $img -}}
{{- else if or (contains "@" $img) (contains ":" $img) -}}
{{- printf "%s/%s" $hub $img -}}
{{- else -}}
{{- printf "%s/%s:%s" $hub ($img | default "meshcni") (include "meshcni.tag" .) -}}
{{- end -}}
{{- end -}}

{{- define "meshcni.agentName" -}}
{{- printf "%s-agent" (include "meshcni.fullname" .) -}}
{{- end -}}

{{- define "meshcni.pluginName" -}}
{{- printf "%s-plugin" (include "meshcni.fullname" .) -}}
{{- end -}}

{{/*
The user name of a ServiceAccount of the release in admission requests. Call with
(dict "ctx" . "name" "<service account>").
*/}}
{{- define "meshcni.saUser" -}}
{{- printf "system:serviceaccount:%s:%s" .ctx.Release.Namespace .name -}}
{{- end -}}

{{- define "meshcni.taintName" -}}
{{- printf "%s-taint-controller" (include "meshcni.fullname" .) -}}
{{- end -}}

{{/*
Does the repair controller act through the API on pods? Returns "delete", "patch" or "".
*/}}
{{- define "meshcni.repairPodVerb" -}}
{{- if .Values.repair.enabled -}}
{{- if eq .Values.repair.action "delete" -}}delete{{- else if eq .Values.repair.action "label" -}}patch{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The taint controller's node selector (--node-selector): taintController.nodeSelectorLabels,
else the agent's nodeSelector as a label selector, so that a node the agent is never
scheduled on (e.g. a Windows node) is never tainted. "" when both are empty: every node.
*/}}
{{- define "meshcni.taintNodeSelector" -}}
{{- if .Values.taintController.nodeSelectorLabels -}}
{{- .Values.taintController.nodeSelectorLabels -}}
{{- else -}}
{{- $terms := list -}}
{{- range $k, $v := .Values.nodeSelector -}}
{{- $terms = append $terms (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $terms -}}
{{- end -}}
{{- end -}}

{{/*
"true" when the agent's audit runs (audit.period not 0), else "": the audit enters pods'
network namespaces and, with escapedAction delete, deletes escaped pods.
*/}}
{{- define "meshcni.auditOn" -}}
{{- if and .Values.audit (not (has (toString (.Values.audit.period | default "60s")) (list "0" "0s"))) }}true{{ end -}}
{{- end }}
