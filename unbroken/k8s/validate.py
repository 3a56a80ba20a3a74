"""Rendered manifests checked offline, as the API server and JobSet's webhook would check them.

* the JobSet against the JobSet CRD's ``openAPIV3Schema`` (vendored: ``schemas/``), strictly:
  a field the schema does not name is an error, as ``kubectl apply`` (strict field validation,
  its default) makes it;
* each replicated job's template, as a ``batch/v1`` Job, and every core object (Service,
  PersistentVolumeClaim) against Kubernetes' own schemas of ``version``, strictly, with
  ``kubernetes-validate`` (the ``[k8s]`` extra);
* the checks of JobSet's webhook that these manifests could fail: rule names, targets that
  exist, RestartJob only with the gate and at most 1,024 child Jobs per replicated job, child
  Job and pod names within 63 characters.

Returns every problem found (empty: valid), each naming the object and the field.
"""

from __future__ import annotations

import functools
import json
import re
from importlib import resources
from typing import Any

from unbroken import extras

SCHEMA = "jobset-v1alpha2-v0.12.0.json"
K8S_VERSION = "1.31.0"  # the oldest Kubernetes JobSet v0.12 supports; tests also check the newest
MAX_NAME = 63
_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_RESTART_JOB_REPLICAS = 1024


def _strict(schema: Any) -> Any:
    """Every object schema that lists its properties refuses others (unless it preserves them)."""
    if isinstance(schema, list):
        return [_strict(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=1)
def jobset_schema() -> dict[str, Any]:
    text = resources.files("unbroken.k8s").joinpath("schemas").joinpath(SCHEMA).read_text()
    return _strict(json.loads(text))


def _where(error: Any) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top)"


def check_jobset(obj: dict[str, Any], restart_job_gate: bool, version: str = K8S_VERSION) -> list[str]:
    jsonschema = extras.require("jsonschema", "k8s", "validating Kubernetes manifests")
    name = obj.get("metadata", {}).get("name", "?")
    validator = jsonschema.Draft7Validator(jobset_schema())
    out = [f"JobSet {name}: {_where(e)}: {e.message}" for e in validator.iter_errors(obj)]
    out += [f"JobSet {name}: {p}" for p in webhook(obj, restart_job_gate)]
    kv = extras.require("kubernetes_validate", "k8s", "validating Kubernetes manifests")
    for rjob in obj.get("spec", {}).get("replicatedJobs", []):
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{name}-{rjob.get('name')}-0"},
            **rjob.get("template", {}),
        }
        out += [f"JobSet {name} replicatedJob {rjob.get('name')}: {p}" for p in _core(kv, job, version)]
    return out


def webhook(obj: dict[str, Any], restart_job_gate: bool) -> list[str]:
    """JobSet's admission checks (``pkg/webhooks/jobset_webhook.go``) that apply here."""
    out = []
    name = obj["metadata"]["name"]
    spec = obj["spec"]
    rjobs = {r["name"]: r for r in spec["replicatedJobs"]}
    for r in spec["replicatedJobs"]:
        longest_job = f"{name}-{r['name']}-{r['replicas'] - 1}"
        if len(longest_job) > MAX_NAME or not _DNS1035.match(longest_job):
            out.append(f"child Job name {longest_job!r} is not a DNS-1035 label of at most {MAX_NAME} characters")
        job = r["template"]["spec"]
        if job.get("completionMode") == "Indexed" and "completions" in job:
            pod = f"{longest_job}-{job['completions'] - 1}-abcde"
            if len(pod) > MAX_NAME:
                out.append(f"pod name {pod!r} exceeds {MAX_NAME} characters")
        if "podFailurePolicy" in job and job["template"]["spec"].get("restartPolicy") != "Never":
            out.append(f"replicatedJob {r['name']}: a podFailurePolicy needs the pods' restartPolicy Never")
    policy = spec.get("failurePolicy") or {}
    names = [rule["name"] for rule in policy.get("rules", [])]
    if len(set(names)) != len(names):
        out.append(f"failure policy rule names repeat: {names}")
    for rule in policy.get("rules", []):
        if not (_RULE_NAME.match(rule["name"]) and 1 <= len(rule["name"]) <= 128):
            out.append(f"failure policy rule name {rule['name']!r} is invalid")
        for target in rule.get("targetReplicatedJobs", []):
            if target not in rjobs:
                out.append(f"rule {rule['name']} targets {target!r}, which is not a replicatedJob")
        if rule["action"] in ("RestartJob", "RestartJobAndIgnoreMaxRestarts"):
            if not restart_job_gate:
                out.append(f"rule {rule['name']}: {rule['action']} needs the RestartJob feature gate of JobSet")
            big = [r["name"] for r in spec["replicatedJobs"] if r["replicas"] > MAX_RESTART_JOB_REPLICAS]
            if big:
                out.append(f"rule {rule['name']}: {rule['action']} allows at most 1024 replicas, {big} have more")
    for target in (spec.get("successPolicy") or {}).get("targetReplicatedJobs", []):
        if target not in rjobs:
            out.append(f"successPolicy targets {target!r}, which is not a replicatedJob")
    return out


def _core(kv: Any, obj: dict[str, Any], version: str = K8S_VERSION) -> list[str]:
    try:
        kv.validate(obj, version, strict=True)
    except kv.ValidationError as e:
        return [f"{_where(e)}: {e.message}"]
    except kv.SchemaNotFoundError as e:
        return [f"no Kubernetes {version} schema for {obj.get('apiVersion')} {obj.get('kind')}: {e}"]
    return []


def check(objects: list[dict[str, Any]], restart_job_gate: bool, version: str = K8S_VERSION) -> list[str]:
    """Every problem of ``objects`` (as :func:`unbroken.k8s.render.render` returns them)."""
    kv = extras.require("kubernetes_validate", "k8s", "validating Kubernetes manifests")
    out = []
    for obj in objects:
        if obj.get("kind") == "JobSet":
            out += check_jobset(obj, restart_job_gate, version)
        else:
            where = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
            out += [f"{where}: {p}" for p in _core(kv, obj, version)]
    return out
