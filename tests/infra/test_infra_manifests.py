"""The deployment files agree with the code: every command they run parses, every port they declare or probe
is one its process listens on (and answers the probe), every environment variable they set is read by the
code and every one the code requires is set, and every metric they chart or scale on is exported.
Kubernetes objects are the Helm chart's (infra/helm/diptych) as rendered with its default values."""

import inspect
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from django.core.management import get_commands, load_command_class
from django.test import Client

from diptych_server import cli
from diptych_server.cli import _parser
from tests.infra.chart import RELEASE, default_objects

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
SOURCES_OF_METRICS = [REPO / "gateway" / "metrics.py", REPO / "workers" / "serving" / "metrics.py"]
CODE = [REPO / "gateway", REPO / "workers", REPO / "diptych_server", REPO / "diptych_common", REPO / "platform"]
# Where each kind of process serves gRPC health (what a `grpc:` probe asks).
SERVES_GRPC_HEALTH = {
    cli._run_gateway: REPO / "gateway" / "main.py",
    cli._run_worker: REPO / "workers" / "main.py",
    cli._run_kv_tier: REPO / "workers" / "kv_tier" / "server.py",
}
WORKLOADS = {"Deployment", "StatefulSet", "Job"}
# Compose's entrypoint, which adds the variables it exports from the credentials volume.
WITH_CREDENTIALS = INFRA / "docker" / "with-credentials"


def _k8s_documents():
    return default_objects()


def _compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def _secrets() -> dict[str, set[str]]:
    """Each Secret's keys, by its name."""
    return {d["metadata"]["name"]: set(d["stringData"]) for d in _k8s_documents() if d["kind"] == "Secret"}


def _k8s_containers():
    """(workload, container) for every container, init containers included, of every workload."""
    for document in _k8s_documents():
        if document["kind"] in WORKLOADS:
            spec = document["spec"]["template"]["spec"]
            for container in spec.get("initContainers", []) + spec["containers"]:
                yield document["metadata"]["name"], container


def _diptych_containers():
    """(workload, container, its parsed `diptych` arguments) for every container that runs `diptych`."""
    for workload, container in _k8s_containers():
        if "args" in container:  # the image's entrypoint is `diptych`; others run a command such as manage.py
            yield workload, container, _parse(container)


def _parse(container: dict):
    values = {variable["name"]: variable.get("value", "10.0.0.1") for variable in container.get("env", [])}
    args = []
    for arg in container["args"]:
        for name in re.findall(r"\$\((\w+)\)", arg):
            # Kubernetes leaves an undefined $(NAME) as it is: the process would get the literal text.
            assert name in values, f"{container['name']} uses $({name}) but its env does not define {name}"
        args.append(re.sub(r"\$\((\w+)\)", lambda match: values[match.group(1)], arg))
    return _parser().parse_args(args)


def _compose_services():
    """(service, definition, parsed `diptych` arguments) for every service running a `diptych` command."""
    for service, definition in _compose()["services"].items():
        command = definition.get("command", [])
        if definition.get("image", "").startswith("diptych") and command[:1] == ["diptych"]:
            yield service, definition, _parser().parse_args(command[1:])


def _exported_by_with_credentials() -> set[str]:
    return {
        name
        for line in WITH_CREDENTIALS.read_text().splitlines()
        for name in re.findall(r"^\s*export (.+)", line)
        for name in name.split()
    }


def _listening_ports(args) -> dict[str, int]:
    """The ports a `diptych` process listens on, by the name the manifests give them (0: none, or any)."""
    ports = {
        cli._run_control_plane: lambda: {"http": args.port},
        cli._run_gateway: lambda: {"grpc": args.port, "http": args.http_port, "metrics": args.metrics_port},
        cli._run_worker: lambda: {
            "grpc": args.port,
            "metrics": args.metrics_port,
            "kv-data": args.kv_port if args.role == "decode" else 0,
        },
        cli._run_kv_tier: lambda: {"grpc": args.port},
        cli._run_jobs: lambda: {},
    }[args.run]()
    return {name: port for name, port in ports.items() if port}


def _required_env(args) -> set[str]:
    """What the process refuses to start without: the variables its command requires, and on PostgreSQL (as
    in every deployment) the control plane's secret key, which settings.py demands along with DATABASE_URL."""
    required = set(re.findall(r'_require_env\("(\w+)"\)', inspect.getsource(args.run)))
    if args.run in (cli._run_control_plane, cli._run_jobs):
        required |= {"DATABASE_URL", "DIPTYCH_SECRET_KEY"}
    if args.run in (cli._run_gateway, cli._run_worker, cli._run_kv_tier):
        required.add("DIPTYCH_CONTROL_PLANE_URL")  # its default is loopback, wrong in any deployment
    if args.run is cli._run_kv_tier:
        required.add("DIPTYCH_INTERNAL_TOKEN")  # to fetch the worker RPC secret from the control plane
    return required


# Read by a library the code hands the environment to: boto3's credentials and region (the artifact store).
LIBRARY_VARIABLES = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}


def _variables_the_code_reads() -> set[str]:
    pattern = re.compile(
        r'(?:environ(?:\.get)?[\[(]|getenv\(|_require_env\(|_env_(?:flag|int|list)\()\s*"([A-Z][A-Z0-9_]+)"'
    )
    read = {name for root in CODE for path in root.rglob("*.py") for name in pattern.findall(path.read_text())}
    return read | LIBRARY_VARIABLES


def test_every_diptych_command_parses():
    parsed = [args for _, _, args in _diptych_containers()] + [args for _, _, args in _compose_services()]
    every_part = {cli._run_control_plane, cli._run_jobs, cli._run_gateway, cli._run_worker, cli._run_kv_tier}
    assert {args.run for args in parsed} == every_part
    assert {args.run for _, _, args in _compose_services()} == every_part
    for workload, container in _k8s_containers():
        assert "args" in container or container["command"][:2] == ["python", "manage.py"], workload


def _manage_py_commands():
    for _, container in _k8s_containers():
        if container.get("command", [])[:2] == ["python", "manage.py"]:
            yield container["command"][2:]
    for definition in _compose()["services"].values():
        command = definition.get("command", [])
        if command[:2] == ["sh", "-c"]:
            for part in command[2].split("&&"):
                words = shlex.split(part)
                assert words[:2] == ["python", "manage.py"], f"an unexpected shell step: {part}"
                yield words[2:]


@pytest.mark.parametrize("command", list(_manage_py_commands()), ids=" ".join)
def test_every_manage_py_command_exists_and_its_options_parse(command):
    name, *options = command
    commands = get_commands()
    assert name in commands, f"manage.py has no command {name!r}"
    load_command_class(commands[name], name).create_parser("manage.py", name).parse_args(options)


def test_declared_container_ports_are_the_ports_each_process_listens_on():
    for workload, container, args in _diptych_containers():
        declared = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
        assert declared == _listening_ports(args), f"{workload}/{container['name']}"


def test_every_probe_asks_a_port_that_answers_it():
    for workload, container, args in _diptych_containers():
        declared = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
        env = {variable["name"]: variable.get("value") for variable in container.get("env", [])}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            where = f"{workload}/{container['name']} {kind}"
            if "grpc" in probe:
                assert probe["grpc"]["port"] == _listening_ports(args)["grpc"], where
                assert "add_HealthServicer_to_server" in SERVES_GRPC_HEALTH[args.run].read_text(), where
            elif "httpGet" in probe:
                port = probe["httpGet"]["port"]
                assert declared.get(port, port) == _listening_ports(args)["http"], where
                if args.run is cli._run_gateway:
                    assert probe["httpGet"]["path"] == "/health", where
                    assert 'add_get("/health"' in (REPO / "gateway" / "openai_api" / "app.py").read_text(), where
                    continue
                # The kubelet sends no credentials, and asks by pod IP unless a Host header says otherwise.
                headers = {h["name"]: h["value"] for h in probe["httpGet"].get("httpHeaders", [])}
                assert headers.get("Host") in env["DIPTYCH_ALLOWED_HOSTS"].split(","), where
                response = Client().get(probe["httpGet"]["path"])
                assert response.status_code == 200, f"{where}: {response.status_code}"
            elif "exec" in probe:
                # Only the jobs process, which listens on nothing, is asked by a command: what that command checks
                # is tests/infra/test_chart_jobs_probes.py's part.
                assert args.run is cli._run_jobs, where
            else:
                port = probe["tcpSocket"]["port"]
                assert declared.get(port, port) in _listening_ports(args).values(), where


def test_every_long_running_container_has_a_readiness_probe_on_a_health_endpoint():
    for workload, container, args in _diptych_containers():
        probe = container.get("readinessProbe")
        # A Celery worker serves nothing to probe: it is asked over its broker (test_chart_jobs_probes.py).
        kinds = {"exec"} if args.run is cli._run_jobs else {"grpc", "httpGet"}
        assert probe is not None and kinds & set(probe), f"{workload}/{container['name']}"


def test_prometheus_annotations_name_the_metrics_port():
    for document in _k8s_documents():
        if document["kind"] not in WORKLOADS:
            continue
        template = document["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            metrics = {
                _listening_ports(args).get("metrics")
                for _, container, args in _diptych_containers()
                if container in template["spec"]["containers"]
            }
            assert metrics == {int(annotations["prometheus.io/port"])}, document["metadata"]["name"]


def test_services_send_traffic_to_ports_their_pods_declare():
    documents = _k8s_documents()
    workloads = [d for d in documents if d["kind"] in WORKLOADS]
    for service in (d for d in documents if d["kind"] == "Service"):
        selector = {"matchLabels": service["spec"]["selector"]}
        selected = [d for d in workloads if _selects(selector, d["spec"]["template"]["metadata"]["labels"])]
        assert selected, f"the Service {service['metadata']['name']} selects no workload"
        for workload in selected:
            containers = workload["spec"]["template"]["spec"]["containers"]
            names = {port["name"] for container in containers for port in container.get("ports", [])}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in names, f"{service['metadata']['name']} -> {port['targetPort']}"


def _secrets_of(container: dict) -> set[str]:
    """The keys a container gets from Secrets; each Secret it names must exist."""
    secrets = _secrets()
    keys = set()
    for source in container.get("envFrom", []):
        name = source["secretRef"]["name"]
        assert name in secrets, f"{container['name']} reads the Secret {name}, which the chart does not make"
        keys |= secrets[name]
    return keys


def test_every_process_gets_the_environment_it_requires():
    services = {d["metadata"]["name"]: d for d in _k8s_documents() if d["kind"] == "Service"}
    for workload, container, args in _diptych_containers():
        env = {variable["name"]: variable for variable in container.get("env", [])}
        missing = _required_env(args) - set(env) - _secrets_of(container)
        assert not missing, f"{workload}/{container['name']} lacks {sorted(missing)}"
        if "DIPTYCH_CONTROL_PLANE_URL" in env:
            host, port = _host_and_port(env["DIPTYCH_CONTROL_PLANE_URL"]["value"])
            assert host in services and port in {p["port"] for p in services[host]["spec"]["ports"]}, workload
    listening = {service: _listening_ports(args) for service, _, args in _compose_services()}
    for service, definition, args in _compose_services():
        provided = set(definition.get("environment", {}))
        if definition.get("entrypoint") == ["with-credentials"]:
            provided |= _exported_by_with_credentials() - (
                {"DIPTYCH_FLEET_TOKEN"} if args.run is not cli._run_worker else set()
            )
        missing = _required_env(args) - provided
        assert not missing, f"compose:{service} lacks {sorted(missing)}"
        if "DIPTYCH_CONTROL_PLANE_URL" in definition["environment"]:
            host, port = _host_and_port(definition["environment"]["DIPTYCH_CONTROL_PLANE_URL"])
            assert listening[host]["http"] == port, f"compose:{service}"


def _host_and_port(url: str) -> tuple[str, int]:
    match = re.fullmatch(r"http://([\w-]+):(\d+)", url)
    assert match, f"{url} names no host and port"
    return match.group(1), int(match.group(2))


def test_every_variable_the_files_set_is_one_the_code_reads():
    read = _variables_the_code_reads()
    for workload, container in _k8s_containers():
        substituted = {name for arg in container.get("args", []) for name in re.findall(r"\$\((\w+)\)", arg)}
        for variable in container.get("env", []):
            assert variable["name"] in read | substituted, f"{workload} sets {variable['name']}, which nothing reads"
    for name, keys in _secrets().items():
        assert not keys - read, f"the Secret {name} holds {sorted(keys - read)}, which nothing reads"
    for service, definition, _ in _compose_services():
        unread = set(definition.get("environment", {})) - read
        assert not unread, f"compose:{service} sets {sorted(unread)}, which nothing reads"
    assert not _exported_by_with_credentials() - read


def test_compose_addresses_and_scrape_targets_match_the_services():
    listening = {service: _listening_ports(args) for service, _, args in _compose_services()}
    for service, definition, args in _compose_services():
        if args.run is cli._run_worker:
            assert args.host == service, f"compose:{service} registers {args.host}, which peers cannot resolve"
            if args.kv_tier:
                tier, port = args.kv_tier.split(":")
                assert listening[tier]["grpc"] == int(port), f"compose:{service} --kv-tier {args.kv_tier}"
        for mapping in definition.get("ports", []):
            container_port = int(mapping.rsplit(":", 1)[1])
            assert container_port in listening[service].values(), f"compose:{service} publishes {mapping}"
    prometheus = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    (static,) = [job for job in prometheus["scrape_configs"] if "static_configs" in job]
    for group in static["static_configs"]:
        for target in group["targets"]:
            service, port = target.split(":")
            assert listening[service].get("metrics") == int(port), f"Prometheus scrapes {target}"


def _family(name: str) -> str:
    """A metric's family name: what Prometheus appends to counters and histograms taken off."""
    return re.sub(r"_(bucket|count|sum|total)$", "", name)


def _exported_metric_names() -> set[str]:
    names = set()
    for path in SOURCES_OF_METRICS:
        names.update(_family(name) for name in re.findall(r'"(diptych_[a-z_]+)"', path.read_text()))
    return names


def _referenced_metric_names() -> set[str]:
    texts = [(INFRA / "prometheus" / "adapter-rules.yaml").read_text()]
    dashboard = json.loads((INFRA / "grafana" / "diptych-serving.json").read_text())
    texts += [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    texts += [json.dumps(d) for d in _k8s_documents() if d["kind"] == "HorizontalPodAutoscaler"]
    names = set()
    for text in texts:
        for name in re.findall(r"\b(diptych_[a-z_]+)", text):
            names.add(_family(name))
    return names


def test_dashboard_and_autoscaling_use_metrics_the_code_exports():
    derived: set[str] = set()  # metrics an adapter rule computes itself (none: it passes the gateways' decision on)
    missing = _referenced_metric_names() - _exported_metric_names() - derived
    assert not missing, f"charted or scaled on but never exported: {sorted(missing)}"


def test_fleet_autoscalers_target_their_deployments():
    documents = _k8s_documents()
    deployments = {d["metadata"]["name"] for d in documents if d["kind"] == "Deployment"}
    autoscalers = [d for d in documents if d["kind"] == "HorizontalPodAutoscaler"]
    assert autoscalers
    for document in autoscalers:
        assert document["spec"]["scaleTargetRef"]["name"] in deployments


# ---- network policies: only the gateway reaches worker gRPC, only prefill workers the KV data port ----

STRANGER = {"app": "stranger"}  # any other pod in the namespace, e.g. a tenant's notebook
PREFILL, DECODE = f"{RELEASE}-tiny-prefill", f"{RELEASE}-tiny-decode"
GATEWAY, CONTROL_PLANE, KV_TIER = f"{RELEASE}-gateway", f"{RELEASE}-control-plane", f"{RELEASE}-kv-tier"


def _template_labels() -> dict[str, dict]:
    """Each workload's pod labels, by workload name."""
    return {
        document["metadata"]["name"]: document["spec"]["template"]["metadata"]["labels"]
        for document in _k8s_documents()
        if document["kind"] in WORKLOADS
    }


def _named_ports(workload: str) -> dict[str, int]:
    for document in _k8s_documents():
        if document["kind"] in WORKLOADS and document["metadata"]["name"] == workload:
            containers = document["spec"]["template"]["spec"]["containers"]
            return {port["name"]: port["containerPort"] for c in containers for port in c.get("ports", [])}
    raise KeyError(workload)


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        present = expression["key"] in labels
        value_in = labels.get(expression["key"]) in expression.get("values", [])
        outcome = {"In": present and value_in, "NotIn": not value_in, "Exists": present, "DoesNotExist": not present}[
            expression["operator"]
        ]
        if not outcome:
            return False
    return True


def _peer_admits(peer: dict, source: dict, same_namespace: bool) -> bool:
    if "ipBlock" in peer:
        return False  # pods are not addressed by IP blocks here
    if "namespaceSelector" not in peer and not same_namespace:
        return False
    return _selects(peer.get("podSelector", {}), source)


def _port_admits(rule_ports: list | None, port_name: str, port_number: int) -> bool:
    return rule_ports is None or any(p.get("port") in (port_name, port_number) for p in rule_ports)


def _reachable(target: dict, port_name: str, port_number: int, source: dict, same_namespace: bool = True) -> bool:
    """Whether a pod with `source` labels may open `port` on a pod with `target` labels."""
    policies = [
        d
        for d in _k8s_documents()
        if d["kind"] == "NetworkPolicy"
        and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
        and _selects(d["spec"]["podSelector"], target)
    ]
    if not policies:
        return True  # no policy selects the pod: everything reaches it
    return any(
        _port_admits(rule.get("ports"), port_name, port_number)
        and any(_peer_admits(peer, source, same_namespace) for peer in rule.get("from", [{}]))
        for policy in policies
        for rule in policy["spec"].get("ingress", [])
    )


def test_only_the_gateway_reaches_worker_grpc_and_only_prefill_workers_reach_kv_data():
    labels = _template_labels()
    gateway, control_plane = labels[GATEWAY], labels[CONTROL_PLANE]
    prefill, decode = labels[PREFILL], labels[DECODE]
    prefill_ports, decode_ports = _named_ports(PREFILL), _named_ports(DECODE)
    for worker, ports in ((prefill, prefill_ports), (decode, decode_ports)):
        assert _reachable(worker, "grpc", ports["grpc"], gateway)
        for outsider in (control_plane, STRANGER):
            assert not _reachable(worker, "grpc", ports["grpc"], outsider)
            assert not _reachable(worker, "grpc", ports["grpc"], outsider, same_namespace=False)
    assert _reachable(decode, "grpc", decode_ports["grpc"], prefill)  # GetKvEndpoint
    assert not _reachable(prefill, "grpc", prefill_ports["grpc"], decode)
    assert _reachable(decode, "kv-data", decode_ports["kv-data"], prefill)
    for outsider in (gateway, control_plane, decode, STRANGER):
        assert not _reachable(decode, "kv-data", decode_ports["kv-data"], outsider)


def test_only_workers_reach_the_kv_tier():
    labels = _template_labels()
    port = _named_ports(KV_TIER)["grpc"]
    for worker in (PREFILL, DECODE):
        assert _reachable(labels[KV_TIER], "grpc", port, labels[worker])
    for outsider in (labels[GATEWAY], labels[CONTROL_PLANE], STRANGER):
        assert not _reachable(labels[KV_TIER], "grpc", port, outsider)


def test_prometheus_still_scrapes_the_workers():
    labels = _template_labels()
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    for workload in (PREFILL, DECODE):
        port = _named_ports(workload)["metrics"]
        assert _reachable(labels[workload], "metrics", port, prometheus, same_namespace=False)
        assert not _reachable(labels[workload], "metrics", port, STRANGER)


def test_network_policy_ports_name_ports_their_pods_declare():
    labels = _template_labels()
    for document in _k8s_documents():
        if document["kind"] != "NetworkPolicy":
            continue
        selected = [name for name, pod in labels.items() if _selects(document["spec"]["podSelector"], pod)]
        assert selected, f"{document['metadata']['name']} selects no pod"
        declared = set().union(*(_named_ports(name) for name in selected))
        for rule in document["spec"]["ingress"]:
            for port in rule.get("ports", []):
                assert port["port"] in declared, f"{document['metadata']['name']} names an unknown port"
