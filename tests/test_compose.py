"""compose/ checked without Docker (there is no engine here or in CI): what can be proved from its files.

- The brokers run kafka/cluster.properties, the settings the 3-broker fault tests run on: the file is
  mounted as the image's server.properties, and the per-node ``KAFKA_*`` variables, turned into
  properties the way the apache/kafka image does, set only the per-node keys that
  ``rankwatch.kafka_broker.KafkaNode`` adds, never a cluster-wide one.
- Every rankwatch service's command line parses with rankwatch's own argument parser, and every
  ``RANKWATCH_*`` variable is one rankwatch reads.
- The wiring: workers' bootstrap and replication, serve's token and Prometheus' credentials,
  notify's Alertmanager URL, Grafana's datasource and dashboard folder, the Alertmanager config (amtool).
- The dashboard's queries against a real ``rankwatch serve``: tests/test_dashboard.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from conftest import missing

from rankwatch.cli import build_parser
from rankwatch.contract import INTERNAL_TOPICS, TOPICS
from rankwatch.contract.alerts import SEVERITIES
from rankwatch.kafka_broker import KafkaNode, read_properties
from rankwatch.settings import Settings, env_name
from rankwatch.sinks.alertmanager import api_url
from rankwatch.sinks.api import is_loopback
from rankwatch.sinks.webhook import ALERTMANAGER_API

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
CLUSTER_PROPERTIES = ROOT / "kafka" / "cluster.properties"
SERVER_PROPERTIES = "/mnt/shared/config/server.properties"  # where the apache/kafka image reads a mounted file
DASHBOARD = COMPOSE_DIR / "grafana" / "dashboards" / "rankwatch.json"
DATASOURCES = COMPOSE_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = COMPOSE_DIR / "grafana" / "provisioning" / "dashboards" / "rankwatch.yml"
PROMETHEUS = COMPOSE_DIR / "prometheus" / "prometheus.yml"
ALERTMANAGER = COMPOSE_DIR / "alertmanager" / "alertmanager.yml"
# The image's KafkaDockerWrapper turns every KAFKA_* variable into a property, except these.
KAFKA_ENV_NOT_PROPERTIES = {"KAFKA_VERSION", "KAFKA_HEAP_OPTS", "KAFKA_LOG4J_OPTS", "KAFKA_OPTS", "KAFKA_JMX_OPTS",
                            "KAFKA_JVM_PERFORMANCE_OPTS", "KAFKA_GC_LOG_OPTS", "KAFKA_LOG4J_ROOT_LOGLEVEL",
                            "KAFKA_LOG4J_LOGGERS", "KAFKA_TOOLS_LOG4J_LOGLEVEL", "KAFKA_JMX_HOSTNAME"}


# --- reading the compose file as Compose does ------------------------------------------------------

def interpolate(value, env: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` with ``env`` (default: nothing set);
    a required variable that is unset raises KeyError."""
    env = env or {}

    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"${{{name}}} is required: {arg}")
        return arg if op == ":-" else ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", one, str(value))


def kafka_env_to_properties(environment: dict) -> dict[str, str]:
    """What the apache/kafka image appends to server.properties for these variables (its rule:
    KAFKA_ stripped, lower case, ``_`` -> ``.``, ``___`` -> ``-``, ``__`` -> ``_``)."""
    props = {}
    for key, value in environment.items():
        if key.startswith("KAFKA_") and key not in KAFKA_ENV_NOT_PROPERTIES:
            name = key.removeprefix("KAFKA_").lower().replace("_", ".").replace("...", "-").replace("..", "_")
            props[name] = interpolate(value)
    return props


def bind_source(volume: str) -> Path | None:
    source = volume.split(":")[0]
    return (COMPOSE_DIR / source).resolve() if source.startswith((".", "/")) else None


def mounted_at(service: dict, source: Path) -> list[str]:
    return [v.split(":")[1] for v in service.get("volumes", []) if bind_source(v) == source.resolve()]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict]:
    return compose["services"]


def brokers(services) -> dict[str, dict]:
    return {name: s for name, s in services.items()
            if s.get("image", "").startswith("apache/kafka:") and "KAFKA_NODE_ID" in s.get("environment", {})}


def rankwatch_services(services) -> dict[str, dict]:
    return {name: s for name, s in services.items() if s.get("build", {}).get("dockerfile") == "compose/Dockerfile"}


def parse_command(service: dict):
    return build_parser().parse_args([interpolate(a) for a in service["command"]])


# --- the files ---------------------------------------------------------------------------------------

def test_the_compose_files_parse_and_every_mounted_file_exists(compose, services):
    assert {"kafka-1", "kafka-2", "kafka-3", "worker", "store", "serve", "notify", "alertmanager", "prometheus",
            "grafana"} <= set(services)
    for name, service in services.items():
        assert service.get("image"), f"{name} names no image"
        for volume in service.get("volumes", []):
            source = bind_source(volume)
            named = volume.split(":")[0]
            assert source.exists() if source else named in compose["volumes"], f"{name}: {volume} mounts nothing"
    for path in (PROMETHEUS, ALERTMANAGER, DATASOURCES, DASHBOARD_PROVIDERS):
        assert isinstance(yaml.safe_load(path.read_text()), dict), path
    assert json.loads(DASHBOARD.read_text())["panels"]


# --- brokers -----------------------------------------------------------------------------------------

def test_brokers_run_kafka_cluster_properties_key_by_key(services):
    cluster = read_properties(CLUSTER_PROPERTIES)
    nodes = brokers(services)
    assert len(nodes) == 3
    pom = ET.parse(ROOT / "kafka" / "pom.xml").getroot()
    kafka_version = pom.find("m:properties/m:kafka.version", {"m": "http://maven.apache.org/POM/4.0.0"}).text
    # What KafkaNode adds to cluster.properties per node: the only keys compose may set per node.
    per_node = set(KafkaNode(node_id=1, host="h", port=1, controller_port=2, voters="1@h:2", node_dir=Path("n"),
                             config={}).properties)
    assert not per_node & set(cluster)
    effective = {}
    for name, service in nodes.items():
        assert service["image"] == f"apache/kafka:{kafka_version}", "the image runs the Kafka the fault tests run"
        assert mounted_at(service, CLUSTER_PROPERTIES) == [SERVER_PROPERTIES], f"{name} must mount cluster.properties"
        env_props = kafka_env_to_properties(service["environment"])
        assert set(env_props) == per_node, f"{name}: per-node keys differ from KafkaNode's: {set(env_props) ^ per_node}"
        # the image appends the variables to the mounted file: a later key wins, as in java.util.Properties
        effective[name] = {**read_properties(CLUSTER_PROPERTIES), **env_props}
        for key, value in cluster.items():
            assert effective[name][key] == value, f"{name}: {key}={effective[name][key]}, cluster.properties says {value}"
        assert effective[name]["process.roles"] == "broker,controller"
        assert effective[name]["advertised.listeners"].split(",")[0] == f"PLAINTEXT://{service['hostname']}:9092"
    voters = {p["controller.quorum.voters"] for p in effective.values()}
    assert len(voters) == 1, "one quorum"
    expected = ",".join(f"{p['node.id']}@{nodes[n]['hostname']}:9093" for n, p in sorted(effective.items()))
    assert voters == {expected}
    assert sorted(int(p["node.id"]) for p in effective.values()) == [1, 2, 3]
    assert len({interpolate(s["environment"]["CLUSTER_ID"]) for s in nodes.values()}) == 1
    # One broker may die without losing an acknowledged write.
    replicas, min_isr = int(cluster["default.replication.factor"]), int(cluster["min.insync.replicas"])
    assert (replicas, min_isr) == (3, 2) and len(nodes) >= replicas


def test_the_broker_parity_check_catches_an_override(services):
    """A KAFKA_* variable for a cluster-wide key would silently win over cluster.properties."""
    service = next(iter(brokers(services).values()))
    env = {**service["environment"], "KAFKA_MIN_INSYNC_REPLICAS": "1"}
    props = kafka_env_to_properties(env)
    assert props["min.insync.replicas"] == "1" and "min.insync.replicas" in read_properties(CLUSTER_PROPERTIES)
    assert kafka_env_to_properties({"KAFKA_A__B___C_D": "x"}) == {"a_b-c.d": "x"}


def test_rankwatch_topics_get_the_clusters_replication_and_reach_every_broker(services):
    cluster = read_properties(CLUSTER_PROPERTIES)
    internal = sorted(f"{s['hostname']}:9092" for s in brokers(services).values())
    for name, service in rankwatch_services(services).items():
        env = service["environment"]
        if name in ("worker", "store", "notify"):  # the ones that connect to Kafka
            assert sorted(interpolate(env["RANKWATCH_BOOTSTRAP"]).split(",")) == internal, name
            assert interpolate(env["RANKWATCH_BROKER_FLAVOR"]) == "kafka"
        assert int(interpolate(env["RANKWATCH_REPLICATION_FACTOR"])) == int(cluster["default.replication.factor"])
    worker = services["worker"]
    partitions = int(interpolate(worker["environment"]["RANKWATCH_PARTITIONS"]))
    assert 2 <= worker["deploy"]["replicas"] <= partitions, "more workers than partitions sit idle"


def test_the_topics_job_creates_every_rankwatch_topic_as_the_workers_would_before_they_start(services):
    job, worker = services["topics"], services["worker"]
    assert job["image"] == next(iter(brokers(services).values()))["image"]
    assert job["environment"]["TOPICS"].split() == [*TOPICS, *INTERNAL_TOPICS]
    for var in ("RANKWATCH_BOOTSTRAP", "RANKWATCH_PARTITIONS", "RANKWATCH_REPLICATION_FACTOR"):
        assert job["environment"][var] == worker["environment"][var], var
    script = " ".join(job["command"])
    for flag in ('--bootstrap-server "$$RANKWATCH_BOOTSTRAP" --create --if-not-exists', '--topic "$$topic"',
                 '--partitions "$$RANKWATCH_PARTITIONS"', '--replication-factor "$$RANKWATCH_REPLICATION_FACTOR"'):
        assert flag in script
    assert "for topic in $$TOPICS; do" in script
    for name in ("worker", "store", "notify"):
        assert services[name]["depends_on"]["topics"] == {"condition": "service_completed_successfully"}, name


# --- rankwatch command lines -------------------------------------------------------------------------

def test_every_rankwatch_command_parses_with_rankwatchs_own_parser(services):
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["rankwatch"]' in dockerfile
    settings_vars = {env_name(f) for f in Settings.__dataclass_fields__}
    sources = "".join(p.read_text() for d in ("rankwatch", "sinks") for p in (ROOT / d).rglob("*.py"))
    ran = set()
    for name, service in rankwatch_services(services).items():
        assert "entrypoint" not in service
        try:
            args = parse_command(service)
        except SystemExit:
            pytest.fail(f"{name}: `rankwatch {' '.join(service['command'])}` is not a valid command line")
        ran.add(args.command)
        for var in service["environment"]:
            if var.startswith("RANKWATCH_"):  # a setting, or a variable the CLI reads by name
                assert var in settings_vars or f'"{var}"' in sources, f"{name}: rankwatch never reads {var}"
    assert ran == {"worker", "store", "serve", "notify"}
    others = set(services) - set(rankwatch_services(services)) - {"topics"}  # topics: the test below
    assert not [name for name in others if "command" in services[name] or "entrypoint" in services[name]], \
        "the other images run their own default command, so no command line here goes unchecked"


def test_the_command_check_catches_an_invented_flag():
    with pytest.raises(SystemExit):
        parse_command({"command": ["serve", "--bind", "0.0.0.0"]})
    with pytest.raises(SystemExit):
        parse_command({"command": ["sink"]})


def test_serve_is_reachable_only_with_the_token_prometheus_sends(compose, services):
    serve = services["serve"]
    args = parse_command(serve)
    assert not is_loopback(args.host), "Prometheus and the host reach serve from other containers"
    token_value = serve["environment"]["RANKWATCH_API_TOKEN"]
    with pytest.raises(KeyError):
        interpolate(token_value)  # `docker compose up` refuses to start without a token
    assert interpolate(token_value, {"RANKWATCH_API_TOKEN": "t"}) == "t"
    [secret] = services["prometheus"]["secrets"]
    assert compose["secrets"][secret] == {"environment": "RANKWATCH_API_TOKEN"}
    prometheus = yaml.safe_load(PROMETHEUS.read_text())
    assert mounted_at(services["prometheus"], PROMETHEUS) == ["/etc/prometheus/prometheus.yml"]
    [job] = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"] == {"type": "Bearer", "credentials_file": f"/run/secrets/{secret}"}
    assert job["static_configs"] == [{"targets": [f"serve:{args.port}"]}]
    assert interpolate(serve["environment"]["RANKWATCH_STORE_URL"]) == \
        interpolate(services["store"]["environment"]["RANKWATCH_STORE_URL"])
    assert set(serve["volumes"]) == set(services["store"]["volumes"]), "serve reads the store's volume"


def test_notify_posts_to_alertmanagers_api_and_its_config_is_valid(services):
    notify = services["notify"]
    args = parse_command(notify)
    assert args.webhook and args.format in ALERTMANAGER_API
    url = interpolate(notify["environment"]["RANKWATCH_WEBHOOK_URL"])
    assert urlsplit(url).netloc == "alertmanager:9093"
    assert api_url(url) == "http://alertmanager:9093/api/v2/alerts"
    assert mounted_at(services["alertmanager"], ALERTMANAGER) == ["/etc/alertmanager/alertmanager.yml"]
    assert args.state and args.state.startswith(tuple(v.split(":")[1] for v in notify["volumes"])), \
        "the read position survives a restart"
    # The labels the config groups, routes and inhibits on are labels rankwatch's alerts carry.
    labels = {"alertname", "run", "detector", "metric", "severity", "rank"}  # sinks/webhook.py alert_labels
    config = yaml.safe_load(ALERTMANAGER.read_text())
    assert set(config["route"]["group_by"]) <= labels
    matchers = [m for r in config["route"].get("routes", []) for m in r.get("matchers", [])]
    matchers += [m for r in config.get("inhibit_rules", []) for k in ("source_matchers", "target_matchers")
                 for m in r[k]]
    for matcher in matchers:
        label, value = re.fullmatch(r'(\w+)="([^"]*)"', matcher).groups()
        assert label in labels and (label != "severity" or value in SEVERITIES), matcher
    for rule in config.get("inhibit_rules", []):
        assert set(rule["equal"]) <= labels
    amtool = shutil.which("amtool")
    if amtool is None:
        missing("no amtool (Debian's prometheus-alertmanager; `make test` installs it as root)")
    done = subprocess.run([amtool, "check-config", str(ALERTMANAGER)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_provisions_the_datasource_and_the_dashboard(services):
    grafana = services["grafana"]
    provisioning = mounted_at(grafana, COMPOSE_DIR / "grafana" / "provisioning")
    assert provisioning == ["/etc/grafana/provisioning"]
    [datasource] = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert (datasource["type"], datasource["url"]) == ("prometheus", "http://prometheus:9090")
    assert "prometheus" in services
    [provider] = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert mounted_at(grafana, DASHBOARD.parent) == [provider["options"]["path"]]
    home = interpolate(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {datasource["uid"]}
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in uids, panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"]["uid"] in uids, variable["name"]
