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
}
