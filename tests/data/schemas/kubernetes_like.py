"""A Kubernetes-like Deployment manifest schema of about 200,000 characters.

Shaped like the schemas that kubernetes-validate bundles (a resource with its `$defs`
inlined, as a client sends one): long descriptions make up most of it, objects are
closed (additionalProperties false, like its -strict schemas), labels are maps of
strings, and IntOrString and Quantity are oneOfs of two nullable types, which
overlap on null (the grammar can only approximate them). Built deterministically.
"""

from __future__ import annotations

import random
from typing import Any

Schema = dict[str, Any]

_WORDS = (
    "the of a to is and in for that be this field if specified must when by an are pod "
    "container value default not will it or may with as on which can set more info "
    "https kubernetes io docs concepts object spec status name namespace label selector "
    "volume mount path port protocol resource limit request cpu memory image pull policy "
    "node affinity toleration taint secret config map key reference deprecated optional "
    "required immutable updated controller replica strategy rolling update surge"
)


def _describer(seed: int) -> Any:
    rng = random.Random(seed)
    words = _WORDS.split()

    def describe(length: int = 40) -> str:
        text = " ".join(rng.choice(words) for _ in range(length))
        return text[0].upper() + text[1:] + "."
    return describe


def _ref(name: str) -> Schema:
    return {"$ref": f"#/$defs/{name}"}


def _closed(describe: Any, properties: dict[str, Schema], required: tuple[str, ...] = (),
            words: int = 40) -> Schema:
    schema: Schema = {"description": describe(words), "type": "object",
                      "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


def manifest_schema(min_chars: int = 200_000) -> Schema:
    """The Deployment schema; it grows by volume source kinds until `min_chars`."""
    import json

    describe = _describer(44)

    def string(**keywords: Any) -> Schema:
        return {"description": describe(), "type": "string", **keywords}

    def integer(**keywords: Any) -> Schema:
        return {"description": describe(), "type": "integer", "format": "int32", **keywords}

    defs: dict[str, Schema] = {
        "IntOrString": {"description": describe(20),
                        "oneOf": [{"type": ["string", "null"]}, {"type": ["integer", "null"]}]},
        "Quantity": {"description": describe(60),
                     "oneOf": [{"type": ["string", "null"]}, {"type": ["number", "null"]}]},
        "ObjectMeta": _closed(describe, {
            "name": string(pattern="^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", maxLength=63),
            "namespace": string(maxLength=63),
            "labels": {"description": describe(), "type": "object",
                       "additionalProperties": {"type": "string", "maxLength": 63}},
            "annotations": {"description": describe(), "type": "object",
                            "additionalProperties": {"type": "string"}},
            "generation": integer(minimum=0),
        }),
        "LabelSelector": _closed(describe, {
            "matchLabels": {"description": describe(), "type": "object",
                            "additionalProperties": {"type": "string"}},
            "matchExpressions": {"description": describe(), "type": "array", "items": _closed(
                describe, {"key": string(), "operator": {"enum": ["In", "NotIn", "Exists",
                                                                   "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}},
                ("key", "operator"))},
        }),
        "ResourceRequirements": _closed(describe, {
            "limits": {"description": describe(), "type": "object",
                       "additionalProperties": _ref("Quantity")},
            "requests": {"description": describe(), "type": "object",
                         "additionalProperties": _ref("Quantity")},
        }),
        "ContainerPort": _closed(describe, {
            "containerPort": integer(minimum=1, maximum=65535),
            "name": string(maxLength=15),
            "protocol": {"description": describe(), "enum": ["TCP", "UDP", "SCTP"]},
        }, ("containerPort",)),
        "EnvVar": _closed(describe, {"name": string(), "value": string()}, ("name",)),
        "Probe": _closed(describe, {
            "httpGet": _closed(describe, {"path": string(), "port": _ref("IntOrString"),
                                          "scheme": {"enum": ["HTTP", "HTTPS"]}}, ("port",)),
            "initialDelaySeconds": integer(minimum=0),
            "periodSeconds": integer(minimum=1),
            "failureThreshold": integer(minimum=1),
        }),
        "VolumeMount": _closed(describe, {"name": string(), "mountPath": string(),
                                          "readOnly": {"type": "boolean"}},
                               ("name", "mountPath")),
    }
    defs["Container"] = _closed(describe, {
        "name": string(maxLength=63),
        "image": string(),
        "imagePullPolicy": {"description": describe(), "enum": ["Always", "Never",
                                                                "IfNotPresent"]},
        "command": {"description": describe(), "type": "array", "items": {"type": "string"}},
        "args": {"description": describe(), "type": "array", "items": {"type": "string"}},
        "env": {"description": describe(), "type": "array", "items": _ref("EnvVar")},
        "ports": {"description": describe(), "type": "array", "items": _ref("ContainerPort")},
        "resources": _ref("ResourceRequirements"),
        "livenessProbe": _ref("Probe"),
        "readinessProbe": _ref("Probe"),
        "volumeMounts": {"description": describe(), "type": "array",
                         "items": _ref("VolumeMount")},
    }, ("name",), words=80)
    volume_properties: dict[str, Schema] = {"name": string(maxLength=63)}
    defs["Volume"] = _closed(describe, volume_properties, ("name",))
    defs["PodSpec"] = _closed(describe, {
        "containers": {"description": describe(), "type": "array", "minItems": 1,
                       "items": _ref("Container")},
        "initContainers": {"description": describe(), "type": "array",
                           "items": _ref("Container")},
        "volumes": {"description": describe(), "type": "array", "items": _ref("Volume")},
        "nodeSelector": {"description": describe(), "type": "object",
                         "additionalProperties": {"type": "string"}},
        "restartPolicy": {"description": describe(), "enum": ["Always", "OnFailure", "Never"]},
        "serviceAccountName": string(),
        "terminationGracePeriodSeconds": integer(minimum=0),
    }, ("containers",), words=120)
    defs["DeploymentSpec"] = _closed(describe, {
        "replicas": integer(minimum=0),
        "selector": _ref("LabelSelector"),
        "template": _closed(describe, {"metadata": _ref("ObjectMeta"),
                                       "spec": _ref("PodSpec")}),
        "strategy": _closed(describe, {
            "type": {"enum": ["Recreate", "RollingUpdate"]},
            "rollingUpdate": _closed(describe, {"maxSurge": _ref("IntOrString"),
                                                "maxUnavailable": _ref("IntOrString")}),
        }),
        "minReadySeconds": integer(minimum=0),
    }, ("selector", "template"))
    schema: Schema = _closed(describe, {
        "apiVersion": {"description": describe(), "type": "string", "enum": ["apps/v1"]},
        "kind": {"description": describe(), "type": "string", "enum": ["Deployment"]},
        "metadata": _ref("ObjectMeta"),
        "spec": _ref("DeploymentSpec"),
    }, ("apiVersion", "kind", "metadata", "spec"))
    schema["$defs"] = defs
    # Volume sources, as many as it takes (Kubernetes has about thirty).
    kind = 0
    while len(json.dumps(schema)) < min_chars:
        name = f"VolumeSource{kind:02d}"
        defs[name] = _closed(describe, {
            "path": string(), "readOnly": {"type": "boolean"},
            "sizeLimit": _ref("Quantity"),
            "items": {"description": describe(), "type": "array", "items": _closed(
                describe, {"key": string(), "path": string(), "mode": integer()},
                ("key", "path"))},
        }, ("path",), words=200)
        volume_properties[f"source{kind:02d}"] = _ref(name)
        kind += 1
    return schema
