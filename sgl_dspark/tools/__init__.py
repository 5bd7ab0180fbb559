"""Tooling around the runtime: preparing the default models (`models`), launching and stopping the real SGLang
server for tests, benchmarks and data building (`launch`), the `make demo` walk-through (`demo`) and the knob
table of docs/serving.md (`knobs_doc`).
Nothing on the serving path imports this package (tests/unit/test_layout_of_package.py checks it).
"""
