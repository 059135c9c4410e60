import pytest
from psycopg.conninfo import conninfo_to_dict

from kombu_pgmq._conninfo import make_dsn, redact, url_to_params
from kombu_pgmq.errors import ConfigurationError


def test_full_url():
    params = url_to_params(
        "postgresql://alice:s3cret@db.example.com:6543/app?sslmode=require&application_name=w1"
    )
    assert params == {
        "host": "db.example.com",
        "port": "6543",
        "user": "alice",
        "password": "s3cret",
        "dbname": "app",
        "sslmode": "require",
        "application_name": "w1",
    }


def test_postgres_scheme_and_defaults():
    assert url_to_params("postgres://") == {}
    assert url_to_params("postgres://localhost/db") == {"host": "localhost", "dbname": "db"}


def test_special_characters_in_password_are_decoded():
    params = url_to_params("postgresql://bob:p%40ss%3Aw%2Frd%25%20x@h/db")
    assert params["password"] == "p@ss:w/rd% x"
    dsn = make_dsn(params)
    assert conninfo_to_dict(dsn)["password"] == "p@ss:w/rd% x"


def test_socket_directory_in_query():
    params = url_to_params("postgresql://postgres:@/kombu_pgmq?host=/tmp/Sock%20Dir")
    assert params["host"] == "/tmp/Sock Dir"
    assert params["dbname"] == "kombu_pgmq"
    assert "password" not in params


def test_ipv6_host():
    assert url_to_params("postgresql://u@[::1]:5433/d")["host"] == "::1"


def test_make_dsn_sets_application_name_unless_given():
    assert conninfo_to_dict(make_dsn({"host": "h"}))["application_name"] == "kombu_pgmq"
    given = conninfo_to_dict(make_dsn({"host": "h", "application_name": "mine"}))
    assert given["application_name"] == "mine"


def test_unknown_libpq_keyword_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="Parameter Key Words"):
        make_dsn({"host": "h", "sslmod": "require"})


def test_wrong_scheme_is_a_clear_error_without_password():
    with pytest.raises(ConfigurationError) as info:
        url_to_params("mysql://u:topsecret@h/db")
    assert "postgresql://" in str(info.value)
    assert "topsecret" not in str(info.value)


def test_bad_port_is_a_clear_error_without_password():
    with pytest.raises(ConfigurationError) as info:
        url_to_params("postgresql://u:topsecret@h:notaport/db")
    assert "topsecret" not in str(info.value)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            "postgresql://u:topsecret@h:5432/db?sslmode=require",
            "postgresql://u:**@h:5432/db?sslmode=require",
        ),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("postgresql://h/db?password=topsecret", "postgresql://h/db?password=**"),
        ("host=h password=topsecret dbname=d", "password=** dbname=d host=h"),
    ],
)
def test_redact(raw, expected):
    assert redact(raw) == expected


def test_several_hosts_default_to_the_primary():
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(make_dsn(url_to_params("postgresql://u@a:5432,b:5433/db")))
    assert params["target_session_attrs"] == "read-write"
    given = make_dsn(url_to_params("postgresql://u@a,b/db?target_session_attrs=any"))
    assert conninfo_to_dict(given)["target_session_attrs"] == "any"
    assert "target_session_attrs" not in conninfo_to_dict(
        make_dsn(url_to_params("postgresql://u@a/db"))
    )


def test_failover_list_folds_into_one_multi_host_connection_string():
    from kombu_pgmq._conninfo import failover_params

    params = failover_params(
        [
            "postgresql://u:pw@db1:5433/app?sslmode=require",
            "postgresql://u:pw@db2/app?sslmode=require",
            "postgresql://u:pw@/app?sslmode=require&host=/run/pg",
        ]
    )
    assert params == {
        "user": "u",
        "password": "pw",
        "dbname": "app",
        "sslmode": "require",
        "host": "db1,db2,/run/pg",
        "port": "5433,5432,5432",
    }
    dsn = conninfo_to_dict(make_dsn(params))
    assert dsn["target_session_attrs"] == "read-write"
    assert dsn["sslmode"] == "require"  # kombu's switch would have lost it


def test_failover_urls_that_differ_beyond_host_and_port_are_a_clear_error():
    from kombu_pgmq._conninfo import failover_params

    with pytest.raises(ConfigurationError, match="differ in dbname, sslmode") as info:
        failover_params(
            [
                "postgresql://u:topsecret@db1/app?sslmode=require",
                "postgresql://u:topsecret@db2/other",
            ]
        )
    assert "topsecret" not in str(info.value)


def test_kombu_failover_list_gives_the_transport_every_host_and_no_switching():
    from kombu import Connection

    import kombu_pgmq  # noqa: F401

    conn = Connection(
        "postgresql://u@db1:5433/app?sslmode=require;postgresql://u@db2:5434/app?sslmode=require"
    )
    assert conn.cycle is not None  # kombu would switch to the next URL on errors...
    dsn = conninfo_to_dict(conn.transport.dsn)
    assert (dsn["host"], dsn["port"]) == ("db1,db2", "5433,5434")
    assert dsn["target_session_attrs"] == "read-write"
    assert conn.cycle is None  # ...libpq does it instead (switch() would fail on sslmode=)
    conn.maybe_switch_next()  # a no-op now
    assert conninfo_to_dict(conn.transport.dsn)["host"] == "db1,db2"
