//! How berth's heap gives memory back to the kernel.

/// Tunes glibc's allocator for a long-running server of many threads.
/// Call once, before any thread starts.
///
/// - Two arenas, not eight per CPU: each arena keeps the memory freed in
///   it for reuse by its own threads, so the store's and the runtime's
///   worker threads would each hold on to their own peak.
/// - A fixed threshold for allocating with `mmap`: a block above it (the
///   answer listing every instance, a plan of every instance at
///   adoption) goes back to the kernel when it is freed. Left alone, glibc
///   raises the threshold to the largest block freed so far, so every
///   later block of that size stays in the heap once freed.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    for (param, value) in [
        (nix::libc::M_ARENA_MAX, 2),
        (nix::libc::M_MMAP_THRESHOLD, 256 * 1024),
    ] {
        // SAFETY: `mallopt` takes two integers and changes only glibc's
        // own settings, under its own lock.
        let ret = unsafe { nix::libc::mallopt(param, value) };
        if ret != 1 {
            tracing::warn!(param, value, "glibc refused an allocator setting");
        }
    }
}

/// Returns the pages of every freed block of the heap to the kernel.
///
/// glibc's allocator keeps freed memory for reuse, and can give back only
/// what no live allocation sits among. Adoption at start builds (and
/// drops) a plan of every instance while it allocates what each adopted
/// instance keeps, so without this a restarted node of thousands keeps
/// tens of MiB it no longer uses, for as long as it runs.
pub fn give_back_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes no pointer and touches only glibc's own
    // arenas, each under its lock, so any thread may call it at any time.
    unsafe {
        nix::libc::malloc_trim(0);
    }
}
