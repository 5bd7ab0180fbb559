"""The one seam into SGLang: the plugin entry point and the named, checked patches it applies.

Nothing here runs the algorithm; it wires `sgl_dspark` into SGLang's processes.
"""
