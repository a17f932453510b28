#[tokio::main]
async fn main() {
    // containerd runs `<shim> -info` to learn the runtime's features (the shim framework parses
    // the flag but leaves answering it to the binary).
    if std::env::args_os()
        .skip(1)
        .any(|a| a == "-info" || a == "--info")
    {
        std::process::exit(crab_shim::service::info::print());
    }
    // `-v` as containerd's own shims answer it (the framework fails on it outside containerd).
    if std::env::args_os()
        .skip(1)
        .any(|a| a == "-v" || a == "--version")
    {
        println!(
            "containerd-shim-crab-v1:\n  Version:  {}\n  Runtime:  {}",
            env!("CARGO_PKG_VERSION"),
            crab_shim::RUNTIME_ID
        );
        std::process::exit(0);
    }
    // runc runs the shim as an OCI hook during a restore (bundle::add_loopback_hook).
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == crab_shim::bundle::LOOPBACK_HOOK_ARG)
    {
        match crab_shim::bundle::loopback_hook(std::io::stdin()) {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                eprintln!("crab {}: {e}", crab_shim::bundle::LOOPBACK_HOOK_ARG);
                std::process::exit(1);
            }
        }
    }
    containerd_shim::asynchronous::run::<crab_shim::service::Service>(crab_shim::RUNTIME_ID, None)
        .await;
    // The shim has answered containerd's Shutdown and closed its socket: the last checkpoints
    // of its sandboxes (a container removed right after a turn end) still leave the node
    // before the process does, for a bounded time.
    crab_shim::replication::drain_at_exit().await;
}
