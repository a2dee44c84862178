"""docs/deepspeed_config.md lists every key the reader knows, with the class the reader gives it."""

from __future__ import annotations

from zerokit.config.dsconfig import SCHEMA, rows
from zerokit.config.dsconfig.schema_optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from zerokit.config.dsconfig.table import DOC, markdown_table, table_in


def test_the_docs_table_is_the_schema():
    assert table_in(DOC.read_text()) == markdown_table(), "run: python -m zerokit.config.dsconfig.table --write"


def test_the_table_lists_every_key_once_with_its_class():
    table = table_in(DOC.read_text()).splitlines()[2:]
    listed = {}
    for line in table:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        listed[cells[0].strip("`")] = cells[1]
    expected = {path: key.klass.value for path, key in SCHEMA.items()}
    for kind, tables in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        for type_name, table_keys in tables.items():
            expected.update({f"{kind}.params.{name} ({type_name})": key.klass.value
                             for name, key in table_keys.items()})
    assert listed == expected and len(table) == len(rows())
