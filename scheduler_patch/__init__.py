"""The one seam into SGLang: everything that imports SGLang or reaches into its objects.

The plugin entry point (`plugin`) and the named, checked patches it applies (`patches`, `algorithm`, `server_args`,
`errors`, `metrics`, `request_checks`, `backends`, `target_gemm`), the launch plan (`launch`), and the DSPARK worker
that drives SGLang's batches (`runtime/`). The algorithm itself is `sgl_dspark`'s, which imports nothing from here.
"""
