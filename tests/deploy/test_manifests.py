"""The Kubernetes deployment: kustomize builds base and the sim overlay, every object validates
against the Kubernetes (and Prometheus Operator) schemas, yamllint is clean, and the wiring the
sidecar depends on (shared socket and /dev/shm, one GPU for both containers, probes, token,
NetworkPolicy, PodMonitor) is what the docs say."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from cloudcoil.models.prometheus_operator import v1 as monitoring

from tests.deploy.manifests import container, find, mounts, render
from tests.deploy.tools import DEPLOY, require_tool, run_tool

K8S_VERSION = "1.34.0"  # resource.k8s.io/v1 (DRA) is GA from 1.34
ENGINES = ("kvxferd-prefill", "kvxferd-decode")
CRDS = {"PodMonitor": monitoring.PodMonitor, "PrometheusRule": monitoring.PrometheusRule}


def _validate(obj: dict) -> None:
    """Strict schema validation: built-in kinds by kubernetes-validate, CRDs by the operator's
    models (a round trip that must keep every field, so unknown fields fail too)."""
    if obj["kind"] in CRDS:
        model = CRDS[obj["kind"]].model_validate(obj)
        dumped = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
        assert dumped == obj, f"{obj['kind']}: fields the schema does not know"
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_yamllint_is_clean_on_every_yaml_file():
    yamllint = require_tool("yamllint")
    config = DEPLOY / ".yamllint.yaml"
    result = run_tool([yamllint, "--strict", "-c", str(config), str(DEPLOY)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("tree", ["base", "sim"])
def test_every_rendered_object_validates_against_its_schema(tree):
    objects = render(tree)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "Secret", "NetworkPolicy", "PodMonitor"} <= kinds
    for obj in objects:
        _validate(obj)


def test_validation_rejects_an_unknown_field_and_a_wrong_type():
    deployment = find(render("base"), "Deployment", "kvxferd-prefill")
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][1]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(typo)
    monitor = copy.deepcopy(find(render("base"), "PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["prot"] = "peer"
    with pytest.raises(AssertionError, match="fields the schema does not know"):
        _validate(monitor)


@pytest.mark.parametrize("tree", ["base", "sim"])
@pytest.mark.parametrize("name", ENGINES)
def test_engine_and_sidecar_share_the_socket_and_dev_shm(tree, name):
    deployment = find(render(tree), "Deployment", name)
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    engine, sidecar = container(deployment, "engine"), container(deployment, "kvxferd")
    for c in (engine, sidecar):
        assert mounts(c)["engine-socket"] == "/run/kvxferd"
        assert mounts(c)["dshm"] == "/dev/shm"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["dshm"]["emptyDir"]["sizeLimit"]
    assert "--engine-socket=/run/kvxferd/engine.sock" in sidecar["args"]
    assert not spec.get("shareProcessNamespace", False)


@pytest.mark.parametrize("name", ENGINES)
def test_both_containers_see_the_same_gpu_through_one_claim(name):
    objects = render("base")
    deployment = find(objects, "Deployment", name)
    claims = deployment["spec"]["template"]["spec"]["resourceClaims"]
    assert [c["name"] for c in claims] == ["gpu"]
    find(objects, "ResourceClaimTemplate", claims[0]["resourceClaimTemplateName"])
    for c in ("engine", "kvxferd"):
        assert container(deployment, c)["resources"]["claims"] == [{"name": "gpu"}]
    sidecar = container(deployment, "kvxferd")
    assert "rdma/rdma_shared_device_a" in sidecar["resources"]["limits"]  # the placeholder


@pytest.mark.parametrize("tree", ["base", "sim"])
@pytest.mark.parametrize("name", ENGINES)
def test_sidecar_probes_token_and_peer_port(tree, name):
    objects = render(tree)
    deployment = find(objects, "Deployment", name)
    sidecar = container(deployment, "kvxferd")
    assert sidecar["ports"] == [
        {"name": "peer", "containerPort": 7600},
        {"name": "peer-frames", "containerPort": 7601},
    ]
    assert "--peer-port=7600" in sidecar["args"]
    assert "--peer-frames-port=7601" in sidecar["args"]  # fixed: pods may firewall ports
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "peer"}
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "peer"}
    token_dir = mounts(sidecar)["peer-token"]
    assert f"--peer-token-file={token_dir}/token" in sidecar["args"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    secret = find(objects, "Secret", volumes["peer-token"]["secret"]["secretName"])
    assert "token" in secret["stringData"]
    # A rollover's second secret comes from the same Secret (empty outside a rollover).
    assert f"--peer-token-previous-file={token_dir}/previous" in sidecar["args"]
    assert "previous" in secret["stringData"]
    assert all(e["name"] != "KVXFERD_PEER_TOKEN" for e in sidecar.get("env", []))
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] != 0


def test_proxy_fronts_the_prefill_and_decode_services():
    objects = render("base")
    proxy = container(find(objects, "Deployment", "kvxferd-proxy"), "proxy")
    assert proxy["command"] == ["kvxferd", "proxy"]
    args = proxy["args"]
    for role in ("prefill", "decode"):
        url = args[args.index(f"--{role}") + 1]
        service = find(objects, "Service", f"kvxferd-{role}")
        assert url == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    find(objects, "Service", "kvxferd-proxy")


def _pod_labels(objects: list[dict]) -> list[dict]:
    return [
        find(objects, "Deployment", n)["spec"]["template"]["metadata"]["labels"] for n in ENGINES
    ]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_headless_service_and_pod_monitor_select_every_engine_pod():
    objects = render("base")
    peers = find(objects, "Service", "kvxferd-peers")
    assert peers["spec"]["clusterIP"] == "None"
    monitor = find(objects, "PodMonitor")
    for labels in _pod_labels(objects):
        assert _selects(peers["spec"]["selector"], labels)
        assert _selects(monitor["spec"]["selector"]["matchLabels"], labels)
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert (endpoint["port"], endpoint["path"]) == ("peer", "/metrics")
    role = endpoint["relabelings"][0]
    assert role["targetLabel"] == "role"
    assert role["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]


def test_network_policy_opens_the_peer_port_only_to_peers_and_prometheus():
    objects = render("base")
    policy = find(objects, "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for labels in _pod_labels(objects):
        assert _selects(policy["spec"]["podSelector"]["matchLabels"], labels)
    proxy_labels = find(objects, "Deployment", "kvxferd-proxy")["spec"]["template"]["metadata"][
        "labels"
    ]
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        sources = rule["from"]
        if not ports:  # all ports: only from peer pods
            assert all("namespaceSelector" not in s for s in sources)
            for s in sources:
                assert any(
                    _selects(s["podSelector"]["matchLabels"], lb) for lb in _pod_labels(objects)
                )
        elif 7600 in ports:
            assert all("namespaceSelector" in s for s in sources)  # Prometheus
        else:
            assert ports == {8000}
            assert all(_selects(s["podSelector"]["matchLabels"], proxy_labels) for s in sources)


@pytest.mark.parametrize("name", ENGINES)
def test_sim_overlay_runs_simulated_engines_on_cpus_only(name):
    objects = render("sim")
    assert not [o for o in objects if o["kind"] == "ResourceClaimTemplate"]
    deployment = find(objects, "Deployment", name)
    spec = deployment["spec"]["template"]["spec"]
    assert "resourceClaims" not in spec
    engine = container(deployment, "engine")
    role = name.removeprefix("kvxferd-")
    assert engine["command"] == ["kvxferd", "sim"]
    assert f"--role={role}" in engine["args"]
    # The sim attaches to the kvxferd container's socket (same path it binds) ...
    sidecar = container(deployment, "kvxferd")
    assert "--engine-socket=/run/kvxferd/engine.sock" in sidecar["args"]
    assert "--sidecar-socket=/run/kvxferd/engine.sock" in engine["args"]
    # ... waiting for it (bounded) well within the engine's startup probe budget.
    wait = float(_flag(engine["args"], "--sidecar-timeout"))
    probe = engine["startupProbe"]
    assert 0 < wait < probe["periodSeconds"] * probe["failureThreshold"]
    for c in spec["containers"]:
        assert c["image"].startswith("kvxferd:"), c["image"]
        resources = c["resources"]
        assert "claims" not in resources
        assert set(resources.get("limits", {})) <= {"cpu", "memory"}
    env = find(objects, "ConfigMap", "kvxferd-env")["data"]
    assert env["UCX_TLS"] == "tcp"
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {
        "kvxferd-sim"
    }


def _flag(args: list[str], name: str) -> str:
    """The value of ``--name=value`` in a container's args (AssertionError if absent)."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"{name}: {values}"
    return values[0]


def _parses(argv: list[str]) -> None:
    """Parse a container's command line with the real ``kvxferd`` parser (no run)."""
    from kvxferd.cli import _parser

    try:
        _parser().parse_args(argv)
    except SystemExit as exc:  # argparse's way to reject
        raise AssertionError(f"kvxferd rejects {argv}") from exc


@pytest.mark.parametrize("tree", ["base", "sim"])
def test_sidecar_and_proxy_command_lines_parse(tree):
    objects = render(tree)
    for name in ENGINES:
        _parses(["serve", *container(find(objects, "Deployment", name), "kvxferd")["args"]])
    proxy = container(find(objects, "Deployment", "kvxferd-proxy"), "proxy")
    _parses([*proxy["command"][1:], *proxy["args"]])


@pytest.mark.parametrize("name", ENGINES)
def test_sim_engine_command_line_parses(name):
    engine = container(find(render("sim"), "Deployment", name), "engine")
    _parses([*engine["command"][1:], *engine["args"]])
