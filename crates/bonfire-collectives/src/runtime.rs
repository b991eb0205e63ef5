use std::sync::OnceLock;

use tokio::runtime::{Builder, Runtime};

/// The runtime bonfire's collectives run on when no other is given: one per process, created
/// on first use, with one worker per core (2 to 8), threads named `bonfire-comm`, placed on the
/// rank's communication CPUs when it has any ([`bonfire_transport::placement`]).
pub fn runtime() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        let workers = std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .clamp(2, 8);
        Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name("bonfire-comm")
            .on_thread_start(|| {
                bonfire_transport::placement::enter(
                    bonfire_transport::placement::Role::Communication,
                )
            })
            .enable_all()
            .build()
            .expect("cannot start the bonfire communication runtime")
    })
}
