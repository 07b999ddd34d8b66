{{/*
Values written for Istio's istio-cni chart (files/istio-cni.yaml lists every one and what
meshcni makes of it; docs/reference.md shows the table). "meshcni.istio" maps them onto
meshcni's values in place, once per rendering (every template includes it first, so the
order Helm renders templates in does not matter), and fails with one line naming a value
meshcni cannot honour.
*/}}
{{- define "meshcni.istio" -}}
{{- if not (hasKey .Values "_meshcniResolved") -}}
{{- include "meshcni.istio.refuse" . -}}
{{- include "meshcni.istio.image" . -}}
{{- include "meshcni.istio.cni" . -}}
{{- include "meshcni.istio.repair" . -}}
{{- include "meshcni.istio.pod" . -}}
{{- include "meshcni.checks" . -}}
{{- $_ := set .Values "_meshcniResolved" true -}}
{{- end -}}
{{- end -}}

{{/*
Every refused Istio value whose value is not one of its accepted ones: fail, naming it.
*/}}
{{- define "meshcni.istio.refuse" -}}
{{- $root := . -}}
{{- range (.Files.Get "files/istio-cni.yaml" | fromYaml).values -}}
{{- if hasKey . "refuse" -}}
{{- $e := . -}}
{{- $v := $root.Values -}}
{{- $found := true -}}
{{- range (splitList "." $e.istio) -}}
{{- if and $found (kindIs "map" $v) (hasKey $v .) -}}
{{- $v = index $v . -}}
{{- else -}}
{{- $found = false -}}
{{- end -}}
{{- end -}}
{{- if $found -}}
{{- $ok := false -}}
{{- range $e.accept -}}
{{- if eq (toJson .) (toJson $v) -}}{{- $ok = true -}}{{- end -}}
{{- end -}}
{{- if not $ok -}}
{{- $shown := toJson $v -}}
{{- if gt (len $shown) 60 -}}{{- $shown = printf "%s…" (trunc 59 $shown) -}}{{- end -}}
{{- fail (printf "Istio istio-cni value %s=%s has no meshcni equivalent: %s" $e.istio $shown $e.refuse) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Image: image, hub, tag, pullPolicy and imagePullSecrets from Istio's names.
*/}}
{{- define "meshcni.istio.image" -}}
{{- $v := .Values -}}
{{- $g := $v.global | default dict -}}
{{- if and $g.hub (or (not $v.hub) (eq $v.hub "ghcr.io/meshcni")) -}}
{{- $_ := set $v "hub" $g.hub -}}
{{- end -}}
{{- if not $v.hub -}}
{{- fail "hub is empty and global.hub is not set: set hub (the registry and path of meshcni's image) or image" -}}
{{- end -}}
{{- if and (not $v.tag) $g.tag -}}
{{- $_ := set $v "tag" (toString $g.tag) -}}
{{- end -}}
{{- if and $g.imagePullPolicy (or (not $v.pullPolicy) (eq $v.pullPolicy "IfNotPresent")) -}}
{{- $_ := set $v "pullPolicy" $g.imagePullPolicy -}}
{{- end -}}
{{- $secrets := list -}}
{{- range (concat ($v.imagePullSecrets | default list) ($g.imagePullSecrets | default list)) -}}
{{- $s := kindIs "map" . | ternary . (dict "name" (toString .)) -}}
{{- if not (has $s $secrets) -}}{{- $secrets = append $secrets $s -}}{{- end -}}
{{- end -}}
{{- $_ := set $v "imagePullSecrets" $secrets -}}
{{- if eq ($v.image | default "") "install-cni" -}}
{{- /* Istio's default image name: meshcni's own image. */ -}}
{{- $_ := set $v "image" "" -}}
{{- end -}}
{{- end -}}

{{/*
CNI: cniBinDir (empty: detected as Istio does), log level, backend, the network name.
*/}}
{{- define "meshcni.istio.cni" -}}
{{- $v := .Values -}}
{{- $g := $v.global | default dict -}}
{{- if not $v.cniBinDir -}}
{{- $_ := set $v "cniBinDir" (contains "-gke" .Capabilities.KubeVersion.GitVersion | ternary "/home/kubernetes/bin" "/opt/cni/bin") -}}
{{- end -}}
{{- $level := (($v.logging | default dict).level) | default (($g.logging | default dict).level) | default "" | toString -}}
{{- if $level -}}
{{- $key := "global.logging.level" -}}
{{- if ($v.logging | default dict).level -}}{{- $key = "logging.level" -}}{{- end -}}
{{- if contains ":" $level -}}
{{- $scoped := "" -}}
{{- range (splitList "," $level) -}}
{{- $kv := splitList ":" (trim .) -}}
{{- if eq (first $kv) "default" -}}{{- $scoped = last $kv -}}{{- end -}}
{{- end -}}
{{- if not $scoped -}}
{{- fail (printf "%s=%q names no default scope: meshcni has one log level; set logLevel (debug, info, warn or error)" $key $level) -}}
{{- end -}}
{{- $level = $scoped -}}
{{- end -}}
{{- if not (has $level (list "debug" "info" "warn" "error")) -}}
{{- fail (printf "%s=%q: meshcni's log levels are debug, info, warn and error; set logLevel" $key $level) -}}
{{- end -}}
{{- $_ := set $v "logLevel" $level -}}
{{- end -}}
{{- if $g.nativeNftables -}}
{{- $_ := set $v "backend" "nftables" -}}
{{- end -}}
{{- if not $v.networkName -}}
{{- $_ := set $v "networkName" (eq $v.provider "multus" | ternary "istio-cni" "meshcni") -}}
{{- end -}}
{{- end -}}

{{/*
Repair: Istio's three booleans, label key, legacy exit code and message, netns directory.
*/}}
{{- define "meshcni.istio.repair" -}}
{{- $r := .Values.repair -}}
{{- if or (hasKey $r "repairPods") (hasKey $r "deletePods") (hasKey $r "labelPods") -}}
{{- if $r.repairPods -}}{{- $_ := set $r "action" "repair" -}}
{{- else if $r.deletePods -}}{{- $_ := set $r "action" "evict" -}}
{{- else if $r.labelPods -}}{{- $_ := set $r "action" "label" -}}
{{- else -}}{{- /* Istio's repair controller then acts on no pod. */ -}}{{- $_ := set $r "enabled" false -}}
{{- end -}}
{{- end -}}
{{- with $r.brokenPodLabelKey -}}{{- $_ := set $r "labelKey" . -}}{{- end -}}
{{- if hasKey $r "initContainerExitCode" -}}{{- $_ := set $r "exitCode" (int $r.initContainerExitCode) -}}{{- end -}}
{{- with $r.initContainerTerminationMsg -}}{{- $_ := set $r "message" (regexQuoteMeta .) -}}{{- end -}}
{{- with .Values.cniNetnsDir -}}
{{- $_ := set $r "netnsDirs" (prepend ($r.netnsDirs | default list) . | uniq) -}}
{{- end -}}
{{- end -}}

{{/*
Pod: resources (global.defaultResources), SELinux and AppArmor as Istio's chart sets them,
an OnDelete update strategy without the default's rollingUpdate.
*/}}
{{- define "meshcni.istio.pod" -}}
{{- $v := .Values -}}
{{- $g := $v.global | default dict -}}
{{- if and (not $v.resources) $g.defaultResources -}}
{{- $_ := set $v "resources" $g.defaultResources -}}
{{- end -}}
{{- $sc := $v.securityContext | default dict -}}
{{- with $v.seLinuxOptions -}}
{{- $_ := set $sc "seLinuxOptions" (merge (deepCopy .) (dict "type" "spc_t")) -}}
{{- end -}}
{{- if hasKey $v "useAppArmorAnnotation" -}}
{{- if $v.useAppArmorAnnotation -}}
{{- $_ := set $v "_agentAnnotations" (dict "container.apparmor.security.beta.kubernetes.io/agent" "unconfined") -}}
{{- else -}}
{{- $_ := set $sc "appArmorProfile" (dict "type" "Unconfined") -}}
{{- end -}}
{{- end -}}
{{- $_ := set $v "securityContext" $sc -}}
{{- with $v.updateStrategy -}}
{{- if eq (.type | default "") "OnDelete" -}}
{{- /* Helm merged the default rollingUpdate in; OnDelete takes none. */ -}}
{{- $_ := unset . "rollingUpdate" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Combinations meshcni refuses.
*/}}
{{- define "meshcni.checks" -}}
{{- $v := .Values -}}
{{- if and $v.taintController.enabled (eq (($v.podLabels | default dict) | dig "k8s-app" "") "istio-cni-node") -}}
{{- fail "podLabels k8s-app=istio-cni-node hands the node taint to istiod's untaint controller (pilot.taint.enabled) while taintController.enabled runs meshcni's: run one, set taintController.enabled=false or remove the label (docs/taint.md)" -}}
{{- end -}}
{{- if and (eq $v.provider "multus") $v.chained -}}
{{- fail "provider multus needs chained=false: Multus runs meshcni as an additional network from its own list" -}}
{{- end -}}
{{- end -}}
