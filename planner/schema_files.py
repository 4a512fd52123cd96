"""The JSON Schemas of trainplan's file formats, generated from the pydantic models that declare
them and written to `docs/schemas/` by `python -m trainplan.planner.schema_files [--out DIR]`.

One declaration per format, beside its reader: a plan (`trainplan.planner.plan_schema.PlanSchema`), a
hardware profile (`trainplan.hardware_profiles.profile_schema.ProfileSchema`, the keys of a `.toml` file)
and a held-out curve (`trainplan.costmodels.stopping.heldout_curve.HeldoutCurveSchema`). The readers
validate through the models; these files are for other tools (editors, CI checks of a plan) and
are generated, never edited: `tests/unit/test_schemas.py` fails when they differ from what the
models generate now. JSON Schema cannot say what the models' validators check (sp_degree x
dp_degree = devices, a covariance's shape, ...), nor that a number is finite.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pydantic import BaseModel

from trainplan.costmodels.stopping.heldout_curve import HeldoutCurveSchema
from trainplan.hardware_profiles.profile_schema import ProfileSchema
from trainplan.planner.plan_schema import PlanSchema

__all__ = ["SCHEMAS", "SCHEMA_DIR", "main", "schema_text", "write_schemas"]

SCHEMAS: dict[str, type[BaseModel]] = {
    "plan.schema.json": PlanSchema,
    "hardware_profile.schema.json": ProfileSchema,
    "heldout_curve.schema.json": HeldoutCurveSchema,
}
"""File name in `docs/schemas/` -> the model it is generated from."""
SCHEMA_DIR = Path("docs") / "schemas"
"""Where the schemas are written, relative to the repository root."""


def schema_text(model: type[BaseModel]) -> str:
    """`model`'s JSON Schema (draft 2020-12, pydantic's validation mode) as the file holds it."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **model.model_json_schema()}
    return json.dumps(schema, indent=2) + "\n"


def write_schemas(out: str | Path = SCHEMA_DIR) -> list[Path]:
    """Write every schema of `SCHEMAS` to the folder `out` (created if missing); returns the paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, model in SCHEMAS.items():
        (folder / name).write_text(schema_text(model), encoding="utf-8")
        paths.append(folder / name)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainplan.planner.schema_files",
                                 description="Write the JSON Schemas of the plan, hardware profile and "
                                             "held-out curve files.")
    ap.add_argument("--out", default=str(SCHEMA_DIR), help="folder to write them to (default: %(default)s)")
    for path in write_schemas(ap.parse_args(argv).out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
