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

/// How often freed heap memory goes back to the kernel while berth serves.
const GIVE_BACK_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Gives freed heap memory back to the kernel once `adopted` resolves (the
/// adoption at start builds, and drops, a plan of every instance) and then
/// every [`GIVE_BACK_EVERY`] until `cancel`.
///
/// glibc keeps freed memory for reuse and by itself gives back only the
/// top of the heap. Answers that list thousands of records, and the
/// adoption, free blocks among ones that live on, so without this a node
/// of thousands keeps tens of MiB it no longer uses: measured at 2,000
/// instances, a listing of every one of them left 10 MiB, of which a trim
/// gave back 9.
pub async fn give_back_freed_while_serving(
    adopted: impl std::future::Future<Output = ()>,
    cancel: tokio_util::sync::CancellationToken,
) {
    tokio::select! {
        () = adopted => give_back_freed().await,
        () = cancel.cancelled() => return,
    }
    let mut every = tokio::time::interval(GIVE_BACK_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => give_back_freed().await,
            () = cancel.cancelled() => return,
        }
    }
}

/// Records in one answer from which the answer gives freed heap memory
/// back at once, not at the next [`GIVE_BACK_EVERY`]: measured at 10,000
/// instances, a listing of every one of them left berth's RSS 23 MiB
/// higher until then.
pub const LARGE_LISTING: usize = 1000;

/// Returns the pages of every freed block of the heap to the kernel; off
/// the async workers, since it walks the whole heap.
pub async fn give_back_freed() {
    let trim = tokio::task::spawn_blocking(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: `malloc_trim` takes no pointer and touches only glibc's
        // own arenas, each under its lock, so any thread may call it at
        // any time.
        unsafe {
            nix::libc::malloc_trim(0);
        }
    });
    let _ = trim.await;
}
