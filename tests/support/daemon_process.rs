//! The workspace's built binaries run as processes: where they are, a port and a config file for
//! the daemon, and a client that waits for it.

use crate::{NODE, client};
use certistack_connector::config::Config;
use certistack_controller::authority::{Authority, IssuedCertificate};
use certistack_proto::v1 as pb;
use certistack_proto::v1::connector_client::ConnectorClient;
use std::path::{Path, PathBuf};
use tonic::transport::Channel;

/// The directory holding this workspace's built binaries (`target/<profile>`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (`cargo build --workspace`), as the README's test command does",
        path.display()
    );
    path
}
/// A TCP port on 127.0.0.1 that nothing listens on at this moment, for a daemon to bind.
pub fn free_local_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Writes `config` as the TOML file the daemon reads, listening on 127.0.0.1:`port`.
pub fn write_config_file(path: &Path, config: &Config, port: u16) {
    let p = |p: &Path| p.display().to_string();
    let text = format!(
        "node_name = \"{}\"\nlisten = \"127.0.0.1:{port}\"\n\
         [tls]\ncertificate = \"{}\"\nprivate_key = \"{}\"\ncontroller_ca = \"{}\"\nrun_authority_public_key = \"{}\"\n\
         [paths]\nstate_dir = \"{}\"\noverlay_root = \"{}\"\n\
         [tools]\nproxmox_backup_client = \"{}\"\nqm = \"{}\"\nqemu_img = \"{}\"\nip = \"{}\"\nnft = \"{}\"\n\
         iptables_legacy_save = \"{}\"\nip6tables_legacy_save = \"{}\"\nguestfish = \"{}\"\n\
         [pve]\nqemu_server_run_dir = \"{}\"\nvm_config_dir = \"{}\"\npbs_loopdev_dir = \"{}\"\npve_cluster_dir = \"{}\"\ndpkg_status = \"{}\"\n\
         sdn_interfaces = \"{}\"\nlvm_conf = \"{}\"\nnodes_dir = \"{}\"\nmounts = \"{}\"\n\
         kvm_device = \"{}\"\ncpuinfo = \"{}\"\ndmi_dir = \"{}\"\n\
         [limits]\n{}\n[sandbox]\n{}\n[process]\n{}\n[guest_network]\n{}",
        config.node_name,
        p(&config.tls.certificate),
        p(&config.tls.private_key),
        p(&config.tls.controller_ca),
        p(&config.tls.run_authority_public_key),
        p(&config.paths.state_dir),
        p(&config.paths.overlay_root),
        p(&config.tools.proxmox_backup_client),
        p(&config.tools.qm),
        p(&config.tools.qemu_img),
        p(&config.tools.ip),
        p(&config.tools.nft),
        p(&config.tools.iptables_legacy_save),
        p(&config.tools.ip6tables_legacy_save),
        p(&config.tools.guestfish),
        p(&config.pve.qemu_server_run_dir),
        p(&config.pve.vm_config_dir),
        p(&config.pve.pbs_loopdev_dir),
        p(&config.pve.pve_cluster_dir),
        p(&config.pve.dpkg_status),
        p(&config.pve.sdn_interfaces),
        p(&config.pve.lvm_conf),
        p(&config.pve.nodes_dir),
        p(&config.pve.mounts),
        p(&config.pve.kvm_device),
        p(&config.pve.cpuinfo),
        p(&config.pve.dmi_dir),
        toml::to_string(&config.limits).unwrap(),
        toml::to_string(&config.sandbox).unwrap(),
        toml::to_string(&config.process).unwrap(),
        toml::to_string(&config.guest_network).unwrap(),
    );
    std::fs::write(path, text).unwrap();
}

/// A client to a connector that is still starting: retried until `Hello` answers (10 s).
pub async fn client_when_up(
    authority: &Authority,
    address: &str,
    identity: &IssuedCertificate,
) -> ConnectorClient<Channel> {
    for _ in 0..100 {
        if let Ok(mut c) = client(authority, address, NODE, identity).await
            && c.hello(pb::HelloRequest {}).await.is_ok()
        {
            return c;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the connector at {address} did not come up");
}

/// The workspace root, where `policy/` lives.
pub fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Runs one of the workspace's binaries as an operator would (without a log filter from the
/// environment); returns its exit code, stdout and stderr.
pub fn run_binary(bin: &str, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(binary(bin))
        .args(args)
        .env_remove("CERTISTACK_LOG")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
