"""SGLang attention backends with hierarchical (tree) verification masks over the paged KV cache.

Pure core (no SGLang): `mask` (SGLang's flattened custom_mask layouts -> one dense [n_b, prefix + n_b] bool
mask per request of n_b verify rows), `paged` (the batch record and the torch reference over a paged cache),
`oracle` (the slow dense-mask check), `csr` (the page table and flat mask FlashInfer's plan reads), `layers`
(what one plan shares across a model's layers, and the start-up refusals), `flashinfer_tree` (plan once, run per
layer with FlashInfer, imported lazily).
SGLang shells, imported only when SGLang builds a backend: `reference` ("dspark_torch": torch_native plus
TARGET_VERIFY, runs on CPU) and `flashinfer_backend` ("dspark_flashinfer"). Registration lives in
scheduler_patch/backends.py; the names live here (no imports), so tools can pass them without the seam.
"""

TORCH_BACKEND = "dspark_torch"
FLASHINFER_BACKEND = "dspark_flashinfer"
