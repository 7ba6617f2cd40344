"""The deployment files agree with the code: every command they run parses, every port they declare or probe
is one its process listens on (and answers the probe), every environment variable they set is read by the
code and every one the code requires is set, and every metric they chart or scale on is exported."""

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

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
SOURCES_OF_METRICS = [REPO / "gateway" / "metrics.py", REPO / "workers" / "metrics.py"]
CODE = [REPO / "gateway", REPO / "workers", REPO / "diptych_server", REPO / "diptych_common", REPO / "platform"]
# Where each kind of process serves gRPC health (what a `grpc:` probe asks).
SERVES_GRPC_HEALTH = {cli._run_gateway: REPO / "gateway" / "main.py", cli._run_worker: REPO / "workers" / "main.py"}


def _k8s_documents():
    for path in sorted((INFRA / "k8s").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            yield path.name, document


def _compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def _secret_keys() -> set[str]:
    (secret,) = [d for _, d in _k8s_documents() if d["kind"] == "Secret"]
    return set(secret["stringData"])


def _k8s_containers():
    """(deployment, container) for every container, init containers included, of every Deployment."""
    for _, document in _k8s_documents():
        if document["kind"] == "Deployment":
            spec = document["spec"]["template"]["spec"]
            for container in spec.get("initContainers", []) + spec["containers"]:
                yield document["metadata"]["name"], container


def _diptych_containers():
    """(deployment, container, its parsed `diptych` arguments) for every container that runs `diptych`."""
    for deployment, container in _k8s_containers():
        if "args" in container:  # the image's entrypoint is `diptych`; others run a command such as manage.py
            yield deployment, container, _parse(container)


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
        if definition.get("image", "").startswith("diptych") and "command" in definition:
            yield service, definition, _parser().parse_args(definition["command"])


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
        cli._run_jobs: lambda: {},
    }[args.run]()
    return {name: port for name, port in ports.items() if port}


def _required_env(args) -> set[str]:
    """What the process refuses to start without: the variables its command requires, and on PostgreSQL (as
    in every deployment) the control plane's secret key, which settings.py demands along with DATABASE_URL."""
    required = set(re.findall(r'_require_env\("(\w+)"\)', inspect.getsource(args.run)))
    if args.run in (cli._run_control_plane, cli._run_jobs):
        required |= {"DATABASE_URL", "DIPTYCH_SECRET_KEY"}
    if args.run in (cli._run_gateway, cli._run_worker):
        required.add("DIPTYCH_CONTROL_PLANE_URL")  # its default is loopback, wrong in any deployment
    return required


def _variables_the_code_reads() -> set[str]:
    pattern = re.compile(r'(?:environ(?:\.get)?[\[(]|getenv\(|_require_env\()\s*"([A-Z][A-Z0-9_]+)"')
    return {name for root in CODE for path in root.rglob("*.py") for name in pattern.findall(path.read_text())}


def test_every_diptych_command_parses():
    parsed = [args for _, _, args in _diptych_containers()] + [args for _, _, args in _compose_services()]
    assert {args.run for args in parsed} == {cli._run_control_plane, cli._run_jobs, cli._run_gateway, cli._run_worker}
    for deployment, container in _k8s_containers():
        assert "args" in container or container["command"][:2] == ["python", "manage.py"], deployment


def _manage_py_commands():
    for _, container in _k8s_containers():
        if container.get("command", [])[:2] == ["python", "manage.py"]:
            yield container["command"][2:]
    for definition in _compose()["services"].values():
        entrypoint = definition.get("entrypoint", [])
        if entrypoint[:2] == ["sh", "-c"]:
            for part in entrypoint[2].split("&&"):
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
    for deployment, container, args in _diptych_containers():
        declared = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
        assert declared == _listening_ports(args), f"{deployment}/{container['name']}"


def test_every_probe_asks_a_port_that_answers_it():
    for deployment, container, args in _diptych_containers():
        declared = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            where = f"{deployment}/{container['name']} {kind}"
            if "grpc" in probe:
                assert probe["grpc"]["port"] == _listening_ports(args)["grpc"], where
                assert "add_HealthServicer_to_server" in SERVES_GRPC_HEALTH[args.run].read_text(), where
            elif "httpGet" in probe:
                port = probe["httpGet"]["port"]
                assert declared.get(port, port) == _listening_ports(args)["http"], where
                response = Client().get(probe["httpGet"]["path"])  # the kubelet sends no credentials
                assert response.status_code == 200, f"{where}: {response.status_code}"
            else:
                port = probe["tcpSocket"]["port"]
                assert declared.get(port, port) in _listening_ports(args).values(), where


def test_prometheus_annotations_name_the_metrics_port():
    for _, document in _k8s_documents():
        if document["kind"] != "Deployment":
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
    documents = [d for _, d in _k8s_documents()]
    deployments = [d for d in documents if d["kind"] == "Deployment"]
    for service in (d for d in documents if d["kind"] == "Service"):
        selector = {"matchLabels": service["spec"]["selector"]}
        selected = [d for d in deployments if _selects(selector, d["spec"]["template"]["metadata"]["labels"])]
        assert selected, f"the Service {service['metadata']['name']} selects no Deployment"
        for deployment in selected:
            containers = deployment["spec"]["template"]["spec"]["containers"]
            names = {port["name"] for container in containers for port in container.get("ports", [])}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in names, f"{service['metadata']['name']} -> {port['targetPort']}"


def test_every_process_gets_the_environment_it_requires():
    secret_keys = _secret_keys()
    services = {d["metadata"]["name"]: d for _, d in _k8s_documents() if d["kind"] == "Service"}
    for deployment, container, args in _diptych_containers():
        env = {variable["name"]: variable for variable in container.get("env", [])}
        from_secret = secret_keys if any("secretRef" in source for source in container.get("envFrom", [])) else set()
        missing = _required_env(args) - set(env) - from_secret
        assert not missing, f"{deployment}/{container['name']} lacks {sorted(missing)}"
        if "DIPTYCH_CONTROL_PLANE_URL" in env:
            host, port = _host_and_port(env["DIPTYCH_CONTROL_PLANE_URL"]["value"])
            assert host in services and port in {p["port"] for p in services[host]["spec"]["ports"]}, deployment
    listening = {service: _listening_ports(args) for service, _, args in _compose_services()}
    for service, definition, args in _compose_services():
        missing = _required_env(args) - set(definition.get("environment", {}))
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
    secret_keys = _secret_keys()
    referenced = set()
    for deployment, container in _k8s_containers():
        substituted = {name for arg in container.get("args", []) for name in re.findall(r"\$\((\w+)\)", arg)}
        for variable in container.get("env", []):
            source = variable.get("valueFrom", {}).get("secretKeyRef")
            if source is not None:
                assert source["key"] in secret_keys, f"{deployment}: no key {source['key']} in the Secret"
                referenced.add(source["key"])
            assert variable["name"] in read | substituted, f"{deployment} sets {variable['name']}, which nothing reads"
    unused = secret_keys - read - referenced
    assert not unused, f"the Secret holds {sorted(unused)}, which nothing reads"
    for service, definition, _ in _compose_services():
        unread = set(definition.get("environment", {})) - read
        assert not unread, f"compose:{service} sets {sorted(unread)}, which nothing reads"


def test_compose_addresses_and_scrape_targets_match_the_services():
    listening = {service: _listening_ports(args) for service, _, args in _compose_services()}
    for service, definition, args in _compose_services():
        if args.run is cli._run_worker:
            assert args.host == service, f"compose:{service} registers {args.host}, which peers cannot resolve"
        for mapping in definition.get("ports", []):
            container_port = int(mapping.rsplit(":", 1)[1])
            assert container_port in listening[service].values(), f"compose:{service} publishes {mapping}"
    prometheus = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    (static,) = [job for job in prometheus["scrape_configs"] if "static_configs" in job]
    for group in static["static_configs"]:
        for target in group["targets"]:
            service, port = target.split(":")
            assert listening[service].get("metrics") == int(port), f"Prometheus scrapes {target}"


def test_the_image_copies_what_exists_and_runs_the_diptych_command():
    dockerfile = (INFRA / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (REPO / source).exists(), f"the Dockerfile copies {source}, which does not exist"
        elif line.startswith("RUN pip install") and "-c constraints.txt" in line:
            for target in line.split("&&")[0].split("constraints.txt")[1].split():
                assert (REPO / target / "pyproject.toml").is_file(), f"pip installs {target}, which is no project"
    (entrypoint,) = re.findall(r'^ENTRYPOINT \["(\w+)"\]', dockerfile, re.MULTILINE)
    project = (REPO / "pyproject.toml").read_text()
    assert re.search(rf'^{entrypoint} = "diptych_server\.cli:main"$', project, re.MULTILINE)


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
    names = set()
    for text in texts:
        for name in re.findall(r"\b(diptych_[a-z_]+)", text):
            names.add(_family(name))
    return names


def test_dashboard_and_autoscaling_use_metrics_the_code_exports():
    derived = {"diptych_worker_kv_blocks_used_ratio"}  # computed by the adapter rule itself
    missing = _referenced_metric_names() - _exported_metric_names() - derived
    assert not missing, f"charted or scaled on but never exported: {sorted(missing)}"


def test_fleet_autoscalers_target_their_deployments():
    documents = list(_k8s_documents())
    deployments = {d["metadata"]["name"] for _, d in documents if d["kind"] == "Deployment"}
    for _, document in documents:
        if document["kind"] == "HorizontalPodAutoscaler":
            assert document["spec"]["scaleTargetRef"]["name"] in deployments


# ---- network policies: only the gateway reaches worker gRPC, only prefill workers the KV data port ----

STRANGER = {"app": "stranger"}  # any other pod in the namespace, e.g. a tenant's notebook


def _template_labels() -> dict[str, dict]:
    """Each Deployment's pod labels, by Deployment name."""
    return {
        document["metadata"]["name"]: document["spec"]["template"]["metadata"]["labels"]
        for _, document in _k8s_documents()
        if document["kind"] == "Deployment"
    }


def _named_ports(deployment: str) -> dict[str, int]:
    for _, document in _k8s_documents():
        if document["kind"] == "Deployment" and document["metadata"]["name"] == deployment:
            containers = document["spec"]["template"]["spec"]["containers"]
            return {port["name"]: port["containerPort"] for c in containers for port in c.get("ports", [])}
    raise KeyError(deployment)


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
        for _, d in _k8s_documents()
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
    gateway, control_plane = labels["gateway"], labels["control-plane"]
    prefill, decode = labels["prefill-diptych-tiny"], labels["decode-diptych-tiny"]
    prefill_ports, decode_ports = _named_ports("prefill-diptych-tiny"), _named_ports("decode-diptych-tiny")
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


def test_prometheus_still_scrapes_the_workers():
    labels = _template_labels()
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    for deployment in ("prefill-diptych-tiny", "decode-diptych-tiny"):
        port = _named_ports(deployment)["metrics"]
        assert _reachable(labels[deployment], "metrics", port, prometheus, same_namespace=False)
        assert not _reachable(labels[deployment], "metrics", port, STRANGER)


def test_network_policy_ports_name_ports_the_workers_declare():
    declared = set(_named_ports("prefill-diptych-tiny")) | set(_named_ports("decode-diptych-tiny"))
    for _, document in _k8s_documents():
        if document["kind"] == "NetworkPolicy":
            for rule in document["spec"]["ingress"]:
                for port in rule.get("ports", []):
                    assert port["port"] in declared, f"{document['metadata']['name']} names an unknown port"
