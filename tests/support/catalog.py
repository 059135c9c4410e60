"""A normalized dump of what a kombu_pgmq install leaves in a database's catalog, to
compare two installs (sql/schema.sql and sql/migrations must give the same schema).

:func:`snapshot` reads, for the schemas ``kombu_pgmq``, ``pgmq`` and ``public``: the
schemas (owner, ACL), relations (kind, persistence, owner, ACL, options, row security,
view definitions), columns in order (type, nullability, default, identity, generated,
collation, ACL), constraints, indexes (``pg_get_indexdef``), triggers
(``pg_get_triggerdef``), rules, policies, sequences (their definition, not their
value), functions (``pg_get_functiondef`` and the attributes it leaves out: ACL, owner),
types (enums, domains, standalone composites), comments; and beyond those schemas the
extensions, event triggers and default privileges. Plus the rows of the tables whose
content is schema rather than data (:data:`SEED_TABLES`). OIDs and values that only say
when something happened (``applied_at``) are left out.

:func:`diff` renders the first differences of two snapshots readably.
"""

from __future__ import annotations

import difflib

import psycopg
from psycopg import sql

__all__ = ["SCHEMAS", "SEED_TABLES", "diff", "snapshot"]

#: Schemas compared object by object: kombu_pgmq's own, PGMQ's (kombu_pgmq creates the
#: queues' tables there through PGMQ), and public (nothing of kombu_pgmq may land there).
SCHEMAS = ("kombu_pgmq", "pgmq", "public")

#: Tables whose rows are part of the schema: ``{(schema, table): columns compared}``.
SEED_TABLES = {
    ("kombu_pgmq", "grantable"): ("function", "kind", "definer"),
    ("kombu_pgmq", "migrations"): ("version", "name"),
}

Snapshot = dict[str, str]

_QUERIES: dict[str, str] = {
    "schema": """
        SELECT n.nspname,
               format('owner=%s acl=%s comment=%s', pg_get_userbyid(n.nspowner), n.nspacl,
                      obj_description(n.oid, 'pg_namespace'))
        FROM pg_namespace n WHERE n.nspname = ANY({schemas})
    """,
    "relation": """
        SELECT c.oid::regclass::text,
               format('kind=%s persistence=%s owner=%s acl=%s options=%s rls=%s/%s comment=%s',
                      c.relkind, c.relpersistence, pg_get_userbyid(c.relowner), c.relacl,
                      c.reloptions, c.relrowsecurity, c.relforcerowsecurity,
                      obj_description(c.oid, 'pg_class'))
               || CASE WHEN c.relkind IN ('v', 'm')
                       THEN E'\n' || pg_get_viewdef(c.oid) ELSE '' END
        FROM pg_class c
        WHERE c.relnamespace::regnamespace::text = ANY({schemas})
          AND c.relkind NOT IN ('i', 'I', 't')
    """,
    "column": """
        SELECT format('%s #%s %s', a.attrelid::regclass, row_number() OVER w, a.attname),
               format('type=%s notnull=%s default=%s identity=%s generated=%s collation=%s '
                      'acl=%s comment=%s',
                      format_type(a.atttypid, a.atttypmod), a.attnotnull,
                      pg_get_expr(d.adbin, d.adrelid), nullif(a.attidentity, ''),
                      nullif(a.attgenerated, ''),
                      CASE WHEN a.attcollation <> 0 THEN a.attcollation::regcollation::text END,
                      a.attacl, col_description(a.attrelid, a.attnum))
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace::regnamespace::text = ANY({schemas})
          AND c.relkind NOT IN ('i', 'I', 't')
          AND a.attnum > 0 AND NOT a.attisdropped
        WINDOW w AS (PARTITION BY a.attrelid ORDER BY a.attnum)
    """,
    "constraint": """
        SELECT format('%s %s', coalesce(con.conrelid::regclass::text, con.contypid::regtype::text),
                      con.conname),
               format('type=%s deferrable=%s deferred=%s validated=%s comment=%s: %s',
                      con.contype, con.condeferrable, con.condeferred, con.convalidated,
                      obj_description(con.oid, 'pg_constraint'), pg_get_constraintdef(con.oid))
        FROM pg_constraint con
        WHERE con.connamespace::regnamespace::text = ANY({schemas})
    """,
    "index": """
        SELECT i.indexrelid::regclass::text,
               format('%s comment=%s', pg_get_indexdef(i.indexrelid),
                      obj_description(i.indexrelid, 'pg_class'))
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE c.relnamespace::regnamespace::text = ANY({schemas})
    """,
    "trigger": """
        SELECT format('%s %s', t.tgrelid::regclass, t.tgname),
               format('enabled=%s comment=%s: %s', t.tgenabled,
                      obj_description(t.oid, 'pg_trigger'), pg_get_triggerdef(t.oid))
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace::regnamespace::text = ANY({schemas}) AND NOT t.tgisinternal
    """,
    "rule": """
        SELECT format('%s.%s %s', r.schemaname, r.tablename, r.rulename), r.definition
        FROM pg_rules r WHERE r.schemaname = ANY({schemas})
    """,
    "policy": """
        SELECT format('%s.%s %s', p.schemaname, p.tablename, p.policyname),
               format('%s %s roles=%s using=%s check=%s', p.permissive, p.cmd, p.roles,
                      p.qual, p.with_check)
        FROM pg_policies p WHERE p.schemaname = ANY({schemas})
    """,
    "sequence": """
        SELECT s.seqrelid::regclass::text,
               format('type=%s start=%s increment=%s min=%s max=%s cache=%s cycle=%s owned_by=%s',
                      s.seqtypid::regtype, s.seqstart, s.seqincrement, s.seqmin, s.seqmax,
                      s.seqcache, s.seqcycle,
                      (SELECT format('%s.%s', d.refobjid::regclass, a.attname)
                       FROM pg_depend d
                       JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
                       WHERE d.classid = 'pg_class'::regclass AND d.objid = s.seqrelid
                         AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')))
        FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
        WHERE c.relnamespace::regnamespace::text = ANY({schemas})
    """,
    "function": """
        SELECT p.oid::regprocedure::text,
               format('kind=%s owner=%s acl=%s security_definer=%s volatility=%s parallel=%s '
                      'strict=%s leakproof=%s cost=%s rows=%s config=%s comment=%s',
                      p.prokind, pg_get_userbyid(p.proowner), p.proacl, p.prosecdef,
                      p.provolatile, p.proparallel, p.proisstrict, p.proleakproof, p.procost,
                      p.prorows, p.proconfig, obj_description(p.oid, 'pg_proc'))
               || CASE WHEN p.prokind IN ('f', 'p')
                       THEN E'\n' || pg_get_functiondef(p.oid) ELSE '' END
        FROM pg_proc p
        WHERE p.pronamespace::regnamespace::text = ANY({schemas})
    """,
    "type": """
        SELECT t.oid::regtype::text,
               format('kind=%s owner=%s acl=%s comment=%s base=%s notnull=%s default=%s '
                      'labels=%s attributes=%s',
                      t.typtype, pg_get_userbyid(t.typowner), t.typacl,
                      obj_description(t.oid, 'pg_type'),
                      CASE WHEN t.typbasetype <> 0 THEN t.typbasetype::regtype::text END,
                      t.typnotnull, t.typdefault,
                      (SELECT array_agg(e.enumlabel ORDER BY e.enumsortorder)
                       FROM pg_enum e WHERE e.enumtypid = t.oid),
                      (SELECT array_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                                        ORDER BY a.attnum)
                       FROM pg_attribute a
                       WHERE a.attrelid = t.typrelid AND a.attnum > 0 AND NOT a.attisdropped))
        FROM pg_type t
        LEFT JOIN pg_class c ON c.oid = t.typrelid
        WHERE t.typnamespace::regnamespace::text = ANY({schemas})
          AND (t.typtype IN ('e', 'd', 'r', 'm')
               OR (t.typtype = 'c' AND c.relkind = 'c')
               OR (t.typtype = 'b' AND t.typcategory <> 'A'))
    """,
    "extension": """
        SELECT e.extname,
               format('version=%s schema=%s owner=%s', e.extversion,
                      e.extnamespace::regnamespace, pg_get_userbyid(e.extowner))
        FROM pg_extension e
    """,
    "event trigger": """
        SELECT e.evtname, format('%s %s enabled=%s', e.evtevent, e.evtfoid::regproc, e.evtenabled)
        FROM pg_event_trigger e
    """,
    "default privileges": """
        SELECT format('%s %s %s', pg_get_userbyid(d.defaclrole),
                      coalesce(d.defaclnamespace::regnamespace::text, '-'), d.defaclobjtype),
               d.defaclacl::text
        FROM pg_default_acl d
    """,
}


def snapshot(
    dsn: str, seed_tables: dict[tuple[str, str], tuple[str, ...]] | None = None
) -> Snapshot:
    """``{"<section> <object>": description}`` of the database at ``dsn`` (see the module
    docstring); ``seed_tables`` (default :data:`SEED_TABLES`) adds one entry per row."""
    items: Snapshot = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        # the same rendering whoever connects (regclass and regprocedure names, defaults)
        conn.execute("SET search_path = pg_catalog")
        conn.execute("SET TIME ZONE 'UTC'")
        for section, query in _QUERIES.items():
            composed = sql.SQL(query).format(schemas=sql.Literal(list(SCHEMAS)))
            for key, text in conn.execute(composed):
                name = f"{section} {key}"
                assert name not in items, f"{name} twice in the catalog snapshot"
                items[name] = text
        tables = SEED_TABLES if seed_tables is None else seed_tables
        for (schema, table), columns in tables.items():
            found = conn.execute(
                "SELECT to_regclass(format('%%I.%%I', %s::text, %s::text))", (schema, table)
            ).fetchone()
            if found == (None,):
                continue
            query = sql.SQL("SELECT {} FROM {}").format(
                sql.SQL(", ").join(map(sql.Identifier, columns)), sql.Identifier(schema, table)
            )
            for row in conn.execute(query):
                items[f"row {schema}.{table} {row!r}"] = ""
    return items


def diff(left: Snapshot, right: Snapshot, names: tuple[str, str], limit: int = 12) -> str:
    """The first ``limit`` differences of two snapshots, readably: objects only one side
    has, then a unified diff of each object that differs. Empty when they are equal."""
    out: list[str] = []
    count = 0
    for key in sorted(left.keys() | right.keys()):
        a, b = left.get(key), right.get(key)
        if a == b:
            continue
        count += 1
        if count > limit:
            continue
        if a is None:
            out.append(f"only in {names[1]}: {key}")
        elif b is None:
            out.append(f"only in {names[0]}: {key}")
        else:
            out.append(f"differs: {key}")
            out.extend(
                "    " + line.rstrip("\n")
                for line in difflib.unified_diff(
                    a.splitlines(), b.splitlines(), names[0], names[1], n=2, lineterm=""
                )
            )
    if count > limit:
        out.append(f"... and {count - limit} more differences")
    return "\n".join(out)
