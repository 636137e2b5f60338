"""Where the bytes live: each bucket's buffers, lifecycle and arenas, the Adam calls over them, pinning, precision conversion and the on-disk state format."""
