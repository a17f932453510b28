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
    containerd_shim::asynchronous::run::<crab_shim::service::Service>(crab_shim::RUNTIME_ID, None)
        .await;
}
