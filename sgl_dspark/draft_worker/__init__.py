"""Drafting behind a narrow client protocol: in the scheduler process (`LocalDraftClient`) or in a separate
draft-worker process over ZMQ (`process` / `transport` / `messages`). The SGLang worker only sees `DraftClient`.
"""
