"""Plan exports: a Plan as the native config of torchtitan, DeepSpeed or accelerate, with what each
cannot express.

`trainplan.planner.export.targets.export_plan(plan, to)` is the entry point (`trainplan export PLAN --to
torchtitan|deepspeed|accelerate`); `trainplan.planner.export.common` holds what every target shares, and one
module per framework maps the plan's decisions onto that framework's keys, each key cited to the
framework's source file and version.
"""
