#[tokio::main]
async fn main() {
    containerd_shim::asynchronous::run::<crab_shim::service::Service>(crab_shim::service::RUNTIME_ID, None).await;
}
