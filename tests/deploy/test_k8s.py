"""deploy/k8s: every manifest valid against the Kubernetes schemas (offline), and every path, port, metric and
option it names one that the server or the router has. Each check also runs on a broken copy, which it must
reject."""
from __future__ import annotations

import copy
import json
import socket
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from . import checks
from .manifests import K8S, ROOT, container, find, load_all, router_routes, serve_metric_names, serve_routes

K8S_VERSION = "1.30.0"  # the oldest we claim: autoscaling/v2 and every field used here exist there
ROUTES = {"serve": serve_routes, "route": router_routes}


@pytest.fixture(scope="module")
def objects():
    return load_all()


@pytest.fixture(scope="module")
def exported():
    return serve_metric_names()


@pytest.fixture
def offline(monkeypatch):
    """Validation must need no network: any connection attempt fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("tried to open a network connection")
    monkeypatch.setattr(socket.socket, "connect", refuse)


def validate(obj: dict) -> None:
    if obj["apiVersion"].startswith("monitoring.coreos.com/"):
        schema = json.loads((Path(__file__).parent / "servicemonitor.schema.json").read_text())
        jsonschema.validate(obj, schema)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_every_manifest_is_valid_offline(objects, offline):
    kinds = {o["kind"] for o in objects}
    assert {"StatefulSet", "Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap", "ServiceMonitor",
            "PersistentVolumeClaim"} <= kinds
    for obj in objects:
        validate(obj)


@pytest.mark.parametrize("kind,path,value", [
    ("StatefulSet", ["spec", "template", "spec", "containers", 0, "ports", 0, "containerPort"], "8000"),
    ("StatefulSet", ["spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet", "pathh"], "/x"),
    ("HorizontalPodAutoscaler", ["spec", "maxReplicas"], "four"),
    ("HorizontalPodAutoscaler", ["spec", "metrics", 0, "pods", "metric", "nam"], "x"),
    ("ServiceMonitor", ["spec", "endpoints", 0, "interval"], "10 seconds"),
    ("ServiceMonitor", ["spec", "endpoint"], []),
])
def test_the_validation_rejects_a_broken_manifest(objects, offline, kind, path, value):
    obj = copy.deepcopy(find(objects, kind))
    _set(obj, path, value)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(obj)


def _set(obj, path, value):
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def broken(objects, kind, name, edit):
    """A copy of the manifests with one object changed by `edit(object)`."""
    changed = copy.deepcopy(objects)
    edit(find(changed, kind, name))
    return changed


def test_probes_name_routes_the_programs_have(objects):
    assert checks.probe_paths(objects, ROUTES) == []
    bad = broken(objects, *checks.SERVE, lambda o: container(o)["livenessProbe"]["httpGet"].update(path="/healthz"))
    assert checks.probe_paths(bad, ROUTES) == ["llmopt-serve livenessProbe: no GET /healthz"]
    bad = broken(objects, *checks.ROUTER, lambda o: container(o)["readinessProbe"]["httpGet"].update(path="/ping"))
    assert checks.probe_paths(bad, ROUTES) == ["llmopt-router readinessProbe: no GET /ping"]  # serve's, not route's


def test_ports_match_the_command_lines_and_services(objects):
    assert checks.ports(objects) == []
    bad = broken(objects, *checks.SERVE, lambda o: container(o)["args"].append("--port=9000"))
    assert checks.ports(bad) == ["llmopt-serve: --port 9000 is not a containerPort [8000]"]
    bad = broken(objects, "Service", "llmopt-router", lambda o: o["spec"]["ports"][0].update(targetPort="web"))
    assert checks.ports(bad) == ["Service llmopt-router: targetPort web not in the pod"]


def test_container_args_are_options_of_the_cli(objects):
    from typer._click.exceptions import UsageError  # what typer's bundled click raises for an unknown option

    for kind, name in (checks.SERVE, checks.ROUTER):
        checks.args(container(find(objects, kind, name)))  # parses: every option exists, every value fits
    bad = broken(objects, *checks.SERVE, lambda o: container(o)["args"].append("--drain-grace-s=5"))
    with pytest.raises(UsageError):
        checks.args(container(find(bad, *checks.SERVE)))
    bad = broken(objects, *checks.ROUTER, lambda o: container(o)["args"].append("--policy-name=x"))
    with pytest.raises(UsageError):
        checks.args(container(find(bad, *checks.ROUTER)))


def test_termination_fits_the_drain(objects):
    assert checks.drain(objects) == []
    bad = broken(objects, *checks.SERVE, lambda o: container(o)["args"].append("--drain-timeout=60"))
    assert checks.drain(bad)[0].startswith("terminationGracePeriodSeconds 50 < preStop 5.0 + drain 5.0 + 60.0")
    bad = broken(objects, *checks.SERVE, lambda o: container(o).pop("startupProbe"))
    assert checks.drain(bad) == ["no startupProbe allowing a 5-minute model load: liveness could kill a loading "
                                 "replica"]
    bad = broken(objects, *checks.SERVE, lambda o: container(o)["livenessProbe"].update(failureThreshold=3))
    assert checks.drain(bad) == ["livenessProbe would restart a draining replica"]
    bad = broken(objects, *checks.ROUTER, lambda o: container(o)["args"].append("--eject-after=10"))
    assert checks.drain(bad) == ["the router ejects a draining replica only after its port closed"]


def test_the_router_lists_every_replica_the_hpa_may_create(objects):
    assert checks.router_replicas(objects) == []
    bad = broken(objects, "HorizontalPodAutoscaler", "llmopt-serve", lambda o: o["spec"].update(maxReplicas=8))
    assert len(checks.router_replicas(bad)) == 1
    bad = broken(objects, "Service", "llmopt-serve", lambda o: o["spec"].pop("clusterIP"))
    assert checks.router_replicas(bad) == ["the replicas' Service is not headless: no per-pod DNS names"]


def test_the_hpa_metric_is_the_adapters_name_for_an_exported_series(objects, exported):
    assert "llmopt:num_requests_waiting" in exported
    assert checks.hpa_metric(objects, exported) == []
    rule = checks.adapter_rule(objects)
    assert checks.exposed_name(rule, "llmopt:num_requests_running") == "llmopt_num_requests_running"

    def rename(metric):
        return lambda o: o["spec"]["metrics"][0]["pods"]["metric"].update(name=metric)
    for wrong in ("llmopt:num_requests_waiting", "llmopt_num_requests_queued"):
        assert checks.hpa_metric(broken(objects, "HorizontalPodAutoscaler", "llmopt-serve", rename(wrong)),
                                 exported) != []

    def series(name):
        return lambda o: o["data"].update({"config.yaml": o["data"]["config.yaml"].replace(
            "llmopt:num_requests_waiting{", name + "{")})
    bad = broken(objects, "ConfigMap", "llmopt-prometheus-adapter", series("llmopt:num_requests_queued"))
    assert checks.hpa_metric(bad, exported)[0].startswith("adapter seriesQuery names llmopt:num_requests_queued")


def test_the_service_monitor_scrapes_both_services(objects):
    assert checks.service_monitor(objects, ROUTES) == []
    bad = broken(objects, "ServiceMonitor", "llmopt", lambda o: o["spec"]["endpoints"][0].update(path="/stats"))
    assert checks.service_monitor(bad, ROUTES) == ["llmopt serve has no GET /stats", "llmopt route has no GET /stats"]
    bad = broken(objects, "ServiceMonitor", "llmopt", lambda o: o["spec"]["endpoints"][0].update(port="metrics"))
    assert len(checks.service_monitor(bad, ROUTES)) == 2
    bad = broken(objects, "Service", "llmopt-router", lambda o: o["metadata"]["labels"].update(
        {"app.kubernetes.io/component": "gateway"}))
    assert checks.service_monitor(bad, ROUTES) == ["ServiceMonitor selects ['llmopt-serve']"]


def test_the_model_comes_from_a_read_only_volume(objects):
    assert checks.model_volume(objects) == []
    bad = broken(objects, *checks.SERVE, lambda o: container(o)["args"].__setitem__(0, "smollm2-135m"))
    assert checks.model_volume(bad) == ["model smollm2-135m is not on a read-only PVC mount"]


def test_cpu_and_memory_requests_and_limits(objects):
    assert checks.resources(objects) == []
    bad = broken(objects, *checks.ROUTER, lambda o: container(o)["resources"]["limits"].pop("memory"))
    assert checks.resources(bad) == ["llmopt-router: no limits memory"]


def test_the_dashboard_config_map_holds_the_dashboard_file(objects):
    import importlib.util

    spec = importlib.util.spec_from_file_location("dashboard_configmap", K8S / "dashboard_configmap.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    text = (ROOT / "deploy" / "grafana" / "llmopt.json").read_text()
    embedded = find(objects, "ConfigMap", "llmopt-grafana-dashboard")["data"]["llmopt.json"]
    assert json.loads(embedded) == json.loads(text), "run: python deploy/k8s/dashboard_configmap.py"
    assert (K8S / "grafana-dashboard.yaml").read_text() == generator.render(text)
    assert json.loads(yaml.safe_load(generator.render('{\n  "a": "x:\\n y"\n}\n'))["data"]["llmopt.json"]) == \
        {"a": "x:\n y"}


def test_the_dockerfile_installs_the_cpu_torch_pin_and_runs_as_a_user():
    lines = (ROOT / "deploy" / "docker" / "Dockerfile").read_text().splitlines()
    torch = next(l for l in ("" if l.startswith("#") else l for l in lines) if "TORCH_VERSION=" in l)
    makefile = (ROOT / "Makefile").read_text()
    assert f"TORCH_VERSION ?= {torch.split('=')[1]}" in makefile  # the same pin as the tests run
    assert "FROM python:3.11-slim" in lines
    assert any("--index-url https://download.pytorch.org/whl/cpu" in l and "torch==${TORCH_VERSION}" in l
               for l in lines)
    users = [l.split()[1] for l in lines if l.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    run_as = find(load_all(), *checks.SERVE)["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert users[-1].split(":")[0] == str(run_as)
