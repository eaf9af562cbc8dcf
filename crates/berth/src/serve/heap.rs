//! Giving freed heap memory back to the kernel.

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
