"""``kombu-pgmq spark server|cluster``: the local Spark Connect server and a standalone
cluster (:mod:`kombu_pgmq.spark`)."""

from __future__ import annotations

import click

from ._base import F, _examples, _fail, _Group, main

# -- Spark ------------------------------------------------------------------------------


@main.group(cls=_Group, epilog=_examples("kombu-pgmq spark server status"))
def spark() -> None:
    """The local Spark Connect server of Spark tasks (kombu_pgmq.spark)."""


@spark.group(
    "server",
    cls=_Group,
    epilog=_examples("kombu-pgmq spark server start --port 15002", "kombu-pgmq spark server stop"),
)
def spark_server() -> None:
    """Start, stop or inspect the local Spark Connect server (one per host and port)."""


def _port_option(func: F) -> F:
    return click.option(
        "--port",
        type=int,
        default=None,
        help="Server port (default: $KOMBU_PGMQ_SPARK_CONNECT_PORT, else 15002).",
    )(func)


@spark_server.command("start", epilog=_examples("kombu-pgmq spark server start --port 15002"))
@_port_option
def spark_server_start(port: int | None) -> None:
    """Start the server unless it is running (it keeps running after this command)."""
    from ..spark import server

    conf = {"spark_connect_port": port} if port else None
    url = server.ensure_running(conf)
    log = server.status(server.local_port(conf))["log"]
    click.echo(f"running: {server.redact_url(url)} (log: {log})")  # the token stays secret


@spark_server.command("stop", epilog=_examples("kombu-pgmq spark server stop"))
@_port_option
def spark_server_stop(port: int | None) -> None:
    """Stop the server started by kombu_pgmq (running Spark jobs are cancelled)."""
    from ..spark import server

    port = port or server.local_port()
    click.echo("stopped" if server.stop(port) else f"no kombu_pgmq Spark server on port {port}")


@spark_server.command("status", epilog=_examples("kombu-pgmq spark server status --port 15002"))
@_port_option
def spark_server_status(port: int | None) -> None:
    """Whether the server answers, its pid and log file."""
    from ..spark import server

    info = server.status(port or server.local_port())
    if info["problem"] is not None:  # another process listens on the port
        _fail(info["problem"])
    state = "running" if info["accepting"] else "not running"
    pid = f", pid {info['pid']}" if info["pid"] is not None else ""
    click.echo(f"{state}: port {info['port']}{pid}, log {info['log']}")


@spark.group(
    "cluster",
    cls=_Group,
    epilog=_examples(
        "kombu-pgmq spark cluster start --workers 2 --cores 1 --memory 1g",
        "kombu-pgmq spark cluster status",
        "kombu-pgmq spark cluster check --broker-url postgresql://app@db:5432/app --path /data",
        "kombu-pgmq spark cluster stop",
    ),
)
def spark_cluster() -> None:
    """A local Spark standalone cluster (master + workers on 127.0.0.1) and its Connect
    server; executor checks for any cluster."""


def _cluster_options(func: F) -> F:
    func = click.option("--port", type=int, default=None, help="Master port (default 7077).")(func)
    func = click.option(
        "--webui-port", type=int, default=None, help="Master web UI port (default 8080)."
    )(func)
    return click.option(
        "--connect-port",
        type=int,
        default=None,
        help="Connect server port (default: $KOMBU_PGMQ_SPARK_CONNECT_PORT, else 15002).",
    )(func)


@spark_cluster.command(
    "start", epilog=_examples("kombu-pgmq spark cluster start --workers 2 --cores 1")
)
@_cluster_options
@click.option("--workers", type=int, default=2, show_default=True, help="Worker processes.")
@click.option("--cores", type=int, default=1, show_default=True, help="Cores per worker.")
@click.option("--memory", default="1g", show_default=True, help="Memory per worker (1g, 512m).")
@click.option(
    "--replace",
    is_flag=True,
    help="If the local Connect server runs on another master (e.g. local[*]), stop it and "
    "start it on this cluster (its running Spark jobs are cancelled).",
)
def spark_cluster_start(
    port: int | None,
    webui_port: int | None,
    connect_port: int | None,
    workers: int,
    cores: int,
    memory: str,
    replace: bool,
) -> None:
    """Start a master, workers and the local Connect server on the cluster (they keep
    running after this command); Spark tasks on this host then run on the cluster.

    A Connect server already running on the port on another master is left alone (exit
    1, naming the fix) unless --replace.
    """
    from ..spark import cluster, server

    port = port or cluster.DEFAULT_MASTER_PORT
    webui_port = webui_port or cluster.DEFAULT_WEBUI_PORT
    connect_port = connect_port or server.local_port()
    running = server.running_master(connect_port)
    if running is not None and running != cluster.master_url(port):
        if not replace:
            _fail(
                f"the local Spark Connect server on port {connect_port} runs on --master "
                f"{running}, not on this cluster ({cluster.master_url(port)}): add --replace "
                "to stop it and start it on the cluster (its running Spark jobs are "
                "cancelled), or stop it yourself (kombu-pgmq spark server stop), or choose "
                "another --connect-port"
            )
        server.stop(connect_port)
        click.echo(
            f"stopped the Connect server on port {connect_port} (it ran on --master {running})"
        )
    info = cluster.start(
        workers=workers, cores=cores, memory=memory, port=port, webui_port=webui_port
    )
    url = server.ensure_running(
        {
            "spark_connect_port": connect_port,
            "spark_local_master": info["master"],
            "spark_local_conf": cluster.application_conf(port),
        }
    )
    click.echo(f"master: {info['master']} (web UI {info['webui']}, files {info['dir']})")
    for worker in info["workers"]:
        click.echo(f"worker: {worker['id']} cores {worker['cores']} ({worker['webuiaddress']})")
    click.echo(f"connect: {server.redact_url(url)} (tasks on this host use it)")


@spark_cluster.command("stop", epilog=_examples("kombu-pgmq spark cluster stop"))
@_cluster_options
def spark_cluster_stop(port: int | None, webui_port: int | None, connect_port: int | None) -> None:
    """Stop the Connect server running on the cluster, then the workers and master."""
    from ..spark import cluster, server

    port = port or cluster.DEFAULT_MASTER_PORT
    connect_port = connect_port or server.local_port()
    if server.running_master(connect_port) == cluster.master_url(port):
        server.stop(connect_port)
        click.echo(f"stopped the Connect server on port {connect_port}")
    click.echo("stopped" if cluster.stop(port) else f"no kombu_pgmq Spark cluster on port {port}")


@spark_cluster.command("status", epilog=_examples("kombu-pgmq spark cluster status"))
@_cluster_options
def spark_cluster_status(
    port: int | None, webui_port: int | None, connect_port: int | None
) -> None:
    """Master, workers (cores used), applications and their executors per worker."""
    from ..spark import cluster, server

    port = port or cluster.DEFAULT_MASTER_PORT
    webui_port = webui_port or cluster.DEFAULT_WEBUI_PORT
    info = cluster.status(port, webui_port)
    if not info["running"]:
        click.echo(f"not running: {info['master']} (files {info['dir']})")
        return
    pid = f", pid {info['pid']}" if info.get("pid") is not None else ""
    click.echo(f"running: {info['master']}{pid}, web UI {info['webui']}")
    executors = cluster.executors_by_worker(webui_port)
    for worker in info["workers"]:
        apps = sorted({e["appid"] for e in executors.get(worker["id"], [])})
        click.echo(
            f"worker: {worker['id']} {worker['state']} cores {worker['coresused']}/"
            f"{worker['cores']} executors of {', '.join(apps) or 'no application'}"
        )
    for app in info["apps"]:
        click.echo(f"application: {app['id']} {app['name']} ({app['cores']} cores)")
    master = server.running_master(connect_port or server.local_port())
    if master is not None:
        click.echo(f"connect server: --master {master}")


@spark_cluster.command(
    "check",
    epilog=_examples(
        "kombu-pgmq spark cluster check --broker-url postgresql://app@db:5432/app --path /data"
    ),
)
@click.option(
    "--remote", default=None, help="Connect URL (default: spark_remote, else the local server)."
)
@click.option("--broker-url", default=None, help="Broker URL the executors must reach.")
@click.option("--path", "paths", multiple=True, help="A path every executor must see.")
def spark_cluster_check(remote: str | None, broker_url: str | None, paths: tuple[str, ...]) -> None:
    """Run one small job on the executors: paths visible, kombu_pgmq importable (the pgmq
    data source), broker reachable. Exit 1 naming each problem and its fix."""
    from ..spark import preflight, session

    url = remote or session.connect_url(start=False)
    reports = preflight.check_remote(url, paths=paths, broker_url=broker_url, datasource=True)
    for r in reports:
        click.echo(f"executor {r.host} pid {r.pid} python {r.python}")
    found = preflight.problems(reports, broker_url=broker_url)
    if found:
        _fail("\n".join(found))
    click.echo(f"ok: {len(reports)} executor process(es) checked")
