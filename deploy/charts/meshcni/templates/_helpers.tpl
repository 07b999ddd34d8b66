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
"true" when admissionPolicies.enabled and the cluster serves ValidatingAdmissionPolicy
(admissionregistration.k8s.io/v1, Kubernetes 1.30 or newer): the policies are shipped and
fence the agent's pod patches to its node and its two labels. Against a cluster (helm
install, upgrade, template --validate) discovery decides; without one (helm template,
whose default API set names no kinds, not even v1/Pod) the Kubernetes version does
(--kube-version), or --api-versions admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy.
*/}}
{{- define "meshcni.policiesServed" -}}
{{- $caps := .Capabilities -}}
{{- $served := $caps.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" -}}
{{- if and (not $served) (not ($caps.APIVersions.Has "v1/Pod")) -}}
{{- $served = semverCompare ">=1.30.0-0" $caps.KubeVersion.Version -}}
{{- end -}}
{{- if and .Values.admissionPolicies.enabled $served }}true{{ end -}}
{{- end -}}

{{/*
The agent's writes to pods, as JSON: what the values ask for, what RBAC grants and what
the agent is told to do.
  fenced        the admission policy fences pod patches to the agent's node
  patch         grant pods patch (fenced, or rbac.unfencedPodWrites names patch)
  evict         grant pods/eviction create (an evict action chosen and
                rbac.unfencedPodWrites names evict: no admission policy can fence an
                eviction to a node, the Eviction names no node)
  mark          the agent's --mark-redirected
  repairAction  the agent's --repair-action ("" with the repair controller off)
  escaped       the agent's --audit-escaped-action
  degraded      what the values asked that the grants do not allow, one line each (NOTES)
delete is an alias of evict, in repair.action, audit.escapedAction and
rbac.unfencedPodWrites alike.
*/}}
{{- define "meshcni.podWrites" -}}
{{- $fenced := eq (include "meshcni.policiesServed" .) "true" -}}
{{- $opt := list -}}
{{- range ((.Values.rbac | default dict).unfencedPodWrites | default list) -}}
{{- $opt = append $opt (eq . "delete" | ternary "evict" .) -}}
{{- end -}}
{{- $canPatch := or $fenced (has "patch" $opt) -}}
{{- $canEvict := has "evict" $opt -}}
{{- $why := $fenced | ternary "" "this cluster serves no ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, Kubernetes 1.30+) or admissionPolicies.enabled is false, so nothing would fence it to the agent's node" -}}
{{- $degraded := list -}}
{{- $action := "" -}}
{{- if .Values.repair.enabled -}}
{{- $action = .Values.repair.action | default "repair" -}}
{{- if eq $action "delete" -}}{{- $action = "evict" -}}{{- end -}}
{{- if and (eq $action "evict") (not $canEvict) -}}
{{- $degraded = append $degraded "repair.action evict needs pods/eviction create, which no admission policy can fence to the agent's node: the repair controller repairs broken pods in place instead (set rbac.unfencedPodWrites={evict} to evict)" -}}
{{- $action = "repair" -}}
{{- end -}}
{{- if and (eq $action "label") (not $canPatch) -}}
{{- $degraded = append $degraded (printf "repair.action label needs pods patch, and %s: the repair controller repairs broken pods in place instead (set rbac.unfencedPodWrites={patch} to label)" $why) -}}
{{- $action = "repair" -}}
{{- end -}}
{{- end -}}
{{- $escaped := (.Values.audit | default dict).escapedAction | default "repair" -}}
{{- if eq $escaped "delete" -}}{{- $escaped = "evict" -}}{{- end -}}
{{- $auditOn := eq (include "meshcni.auditOn" .) "true" -}}
{{- if and (eq $escaped "evict") (not $canEvict) -}}
{{- if $auditOn -}}
{{- $degraded = append $degraded "audit.escapedAction evict needs pods/eviction create, which no admission policy can fence to the agent's node: the audit repairs escaped pods in place instead (set rbac.unfencedPodWrites={evict} to evict)" -}}
{{- end -}}
{{- $escaped = "repair" -}}
{{- end -}}
{{- $mark := $canPatch -}}
{{- if not $canPatch -}}
{{- $degraded = append $degraded (printf "the agent does not label redirected pods meshcni.io/redirected=true (--mark-redirected=false): it needs pods patch, and %s (set rbac.unfencedPodWrites={patch} to label them)" $why) -}}
{{- end -}}
{{- $evict := and $canEvict (or (eq $action "evict") (and $auditOn (eq $escaped "evict"))) -}}
{{- $patch := and $canPatch (or $mark (eq $action "label")) -}}
{{- toJson (dict "fenced" $fenced "patch" $patch "evict" $evict "mark" $mark "repairAction" $action "escaped" $escaped "degraded" $degraded) -}}
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
network namespaces and, with escapedAction evict, evicts escaped pods.
*/}}
{{- define "meshcni.auditOn" -}}
{{- if and .Values.audit (not (regexMatch "^(0+(\\.0*)?(ns|us|µs|ms|s|m|h)?)+$" (toString (.Values.audit.period | default "60s")))) }}true{{ end -}}
{{- end }}
