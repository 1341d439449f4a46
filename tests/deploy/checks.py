"""Checks of deploy/k8s against the code: each returns a list of problems (empty: fine), so the tests can run
it on the real manifests and on broken copies of them."""
from __future__ import annotations

import re

import yaml

from .manifests import container, find, parse_command

SERVE, ROUTER = ("StatefulSet", "llmopt-serve"), ("Deployment", "llmopt-router")
PROBES = ("readinessProbe", "livenessProbe", "startupProbe")


def probe_paths(objects, routes_of) -> list[str]:
    """Every httpGet probe names a GET route of the program its container runs, on a port it declares."""
    problems = []
    for kind, name in (SERVE, ROUTER):
        c = container(find(objects, kind, name))
        routes, ports = routes_of[c["command"][1]](), {p["name"] for p in c["ports"]}
        for probe in PROBES:
            get = c.get(probe, {}).get("httpGet")
            if get and ("GET", get["path"]) not in routes:
                problems.append(f"{name} {probe}: no GET {get['path']}")
            if get and get["port"] not in ports:
                problems.append(f"{name} {probe}: port {get['port']} is not a container port")
    return problems


def args(c: dict):
    """The container's command line parsed by the real CLI: (command, params)."""
    return parse_command([c["command"][1], *c["args"]])


def ports(objects) -> list[str]:
    """--port is the containerPort, and each Service's targetPort is a port its pods declare."""
    problems = []
    for kind, name in (SERVE, ROUTER):
        c = container(find(objects, kind, name))
        declared = {p["containerPort"] for p in c["ports"]}
        if args(c)[1]["port"] not in declared:
            problems.append(f"{name}: --port {args(c)[1]['port']} is not a containerPort {sorted(declared)}")
        if args(c)[1]["host"] != "0.0.0.0":
            problems.append(f"{name}: binds {args(c)[1]['host']}, unreachable from other pods")
        service = find(objects, "Service", name)
        if service["spec"]["selector"] != find(objects, kind, name)["spec"]["template"]["metadata"]["labels"]:
            problems.append(f"Service {name} does not select the pods of {kind} {name}")
        names = {p["name"] for p in c["ports"]} | declared
        problems += [f"Service {name}: targetPort {p['targetPort']} not in the pod" for p in service["spec"]["ports"]
                     if p["targetPort"] not in names]
    return problems


def drain(objects) -> list[str]:
    """The pod lives through preStop + --drain-grace + --drain-timeout; liveness outlasts a drain; the router
    ejects a draining replica within its grace; startup allows a slow load."""
    spec = find(objects, *SERVE)["spec"]["template"]["spec"]
    c, params = container(find(objects, *SERVE)), args(container(find(objects, *SERVE)))[1]
    sleep = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    needed = sleep + params["drain_grace"] + params["drain_timeout"]
    problems = []
    if spec["terminationGracePeriodSeconds"] < needed + 5:
        problems.append(f"terminationGracePeriodSeconds {spec['terminationGracePeriodSeconds']} < preStop "
                        f"{sleep} + drain {params['drain_grace']} + {params['drain_timeout']} + 5")
    live = c["livenessProbe"]
    if live["periodSeconds"] * live["failureThreshold"] <= params["drain_grace"] + params["drain_timeout"]:
        problems.append("livenessProbe would restart a draining replica")
    start = c.get("startupProbe")
    if not start or start["periodSeconds"] * start["failureThreshold"] < 300:
        problems.append("no startupProbe allowing a 5-minute model load: liveness could kill a loading replica")
    route = args(container(find(objects, *ROUTER)))[1]
    if route["health_interval"] * route["eject_after"] >= params["drain_grace"]:
        problems.append("the router ejects a draining replica only after its port closed")
    return problems


def router_replicas(objects) -> list[str]:
    """--replica names each pod the HPA may create, through the headless Service, on the pods' port."""
    serve, hpa = find(objects, *SERVE), find(objects, "HorizontalPodAutoscaler")
    headless = find(objects, "Service", serve["spec"]["serviceName"])
    port = args(container(serve))[1]["port"]
    want = [f"http://{serve['metadata']['name']}-{i}.{headless['metadata']['name']}:{port}"
            for i in range(hpa["spec"]["maxReplicas"])]
    got = args(container(find(objects, *ROUTER)))[1]["replica"]
    problems = [] if got == want else [f"router --replica {got} != {want}"]
    if headless["spec"].get("clusterIP") != "None":
        problems.append("the replicas' Service is not headless: no per-pod DNS names")
    target = hpa["spec"]["scaleTargetRef"]
    if (target["kind"], target["name"]) != SERVE:
        problems.append(f"the HPA scales {target['kind']} {target['name']}")
    return problems


def adapter_rule(objects) -> dict:
    (rule,) = yaml.safe_load(find(objects, "ConfigMap", "llmopt-prometheus-adapter")["data"]["config.yaml"])["rules"]
    return rule


def exposed_name(rule: dict, series: str) -> str | None:
    """The custom-metrics name the adapter gives `series` (Go's ${1} as Python's \\g<1>), None if no match."""
    pattern = re.compile(rule["name"]["matches"])
    if not pattern.search(series):
        return None
    return pattern.sub(re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rule["name"].get("as", "${1}")), series)


def hpa_metric(objects, exported: set[str]) -> list[str]:
    """The HPA's Pods metric is what the adapter rule makes of a series the server exports."""
    rule = adapter_rule(objects)
    series = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["seriesQuery"]).group(0)
    problems = [] if series in exported else [f"adapter seriesQuery names {series}, which /metrics does not export"]
    for m in find(objects, "HorizontalPodAutoscaler")["spec"]["metrics"]:
        name = m["pods"]["metric"]["name"]
        if m["type"] != "Pods" or exposed_name(rule, series) != name:
            problems.append(f"HPA metric {name}: the adapter exposes {series} as {exposed_name(rule, series)}")
        if ":" in name:
            problems.append(f"HPA metric {name} has a colon")
    return problems


def service_monitor(objects, routes_of) -> list[str]:
    """It selects the serve and router Services, by a port name they have, on a path both serve."""
    sm = find(objects, "ServiceMonitor")["spec"]
    selected = [s for s in objects if s["kind"] == "Service" and _selects(sm["selector"], s["metadata"]["labels"])]
    problems = [] if {s["metadata"]["name"] for s in selected} == {SERVE[1], ROUTER[1]} else \
        [f"ServiceMonitor selects {[s['metadata']['name'] for s in selected]}"]
    for endpoint in sm["endpoints"]:
        for s in selected:
            if endpoint["port"] not in {p.get("name") for p in s["spec"]["ports"]}:
                problems.append(f"Service {s['metadata']['name']} has no port named {endpoint['port']}")
        for program, routes in routes_of.items():
            if ("GET", endpoint.get("path", "/metrics")) not in routes():
                problems.append(f"llmopt {program} has no GET {endpoint.get('path')}")
    return problems


def _selects(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        ok = ok and labels.get(e["key"]) in e["values"]
    return ok


def model_volume(objects) -> list[str]:
    """The model source is a path on a read-only PVC mount, and the Hub is off."""
    serve = find(objects, *SERVE)
    c, volumes = container(serve), {v["name"]: v for v in serve["spec"]["template"]["spec"]["volumes"]}
    source = c["args"][0]
    mounts = [m for m in c["volumeMounts"] if source.startswith(m["mountPath"].rstrip("/") + "/")]
    if not mounts or "persistentVolumeClaim" not in volumes[mounts[0]["name"]] or not mounts[0].get("readOnly"):
        return [f"model {source} is not on a read-only PVC mount"]
    claim = volumes[mounts[0]["name"]]["persistentVolumeClaim"]["claimName"]
    problems = [] if any(o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == claim for o in objects) \
        else [f"no PersistentVolumeClaim {claim}"]
    if {"name": "HF_HUB_OFFLINE", "value": "1"} not in c.get("env", []):
        problems.append("HF_HUB_OFFLINE is not 1")
    return problems


def resources(objects) -> list[str]:
    problems = []
    for kind, name in (SERVE, ROUTER):
        r = container(find(objects, kind, name)).get("resources", {})
        problems += [f"{name}: no {side} {what}" for side in ("requests", "limits") for what in ("cpu", "memory")
                     if what not in r.get(side, {})]
    return problems
