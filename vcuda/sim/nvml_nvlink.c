/* NVLink state, remote end of each link, and P2P status; link numbering is derived in sim_spec.c. */
#include "nvml_sim.h"

#include <stdio.h>
#include <string.h>

/* PCI identity reported for the NVSwitch of switch domain d (see README). */
static void fill_switch_pci(unsigned domain, nvmlPciInfo_t *pci, bool legacy_only)
{
    memset(pci->busIdLegacy, 0, sizeof(pci->busIdLegacy));
    pci->domain = 0xFFFF;
    pci->bus = domain & 0xFF;
    pci->device = 0;
    pci->pciDeviceId = (0x22A3u << 16) | 0x10DE; /* NVSwitch */
    pci->pciSubSystemId = pci->pciDeviceId;
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.0", pci->domain, pci->bus, pci->device);
    if (!legacy_only)
        snprintf(pci->busId, sizeof(pci->busId), "%08X:%02X:%02X.0", pci->domain, pci->bus, pci->device);
}

/* Common checks: returns the GPU index with the life-cycle lock held, or an error with nothing held. */
static nvmlReturn_t enter_link(nvmlDevice_t device, unsigned link, const struct sim_ctx **ctx, unsigned *index)
{
    nvmlReturn_t rc = sim_enter_device(device, ctx, index);
    if (rc != NVML_SUCCESS)
        return rc;
    if (link >= NVML_NVLINK_MAX_LINKS)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (!(*ctx)->spec->gpus[*index].has_nvlink)
        rc = NVML_ERROR_NOT_SUPPORTED; /* a GPU without NVLink, e.g. a PCIe card */
    if (rc != NVML_SUCCESS)
        sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = enter_link(device, link, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    if (isActive == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else
        *isActive = ctx->spec->gpus[i].link_peer[link] == SIM_NVLINK_PEER_NONE ? NVML_FEATURE_DISABLED
                                                                                : NVML_FEATURE_ENABLED;
    sim_leave();
    return rc;
}

static nvmlReturn_t remote_pci(nvmlDevice_t device, unsigned link, nvmlPciInfo_t *pci, bool legacy_only)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = enter_link(device, link, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    const struct sim_gpu_spec *g = &ctx->spec->gpus[i];
    int peer = g->link_peer[link];
    if (pci == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (peer == SIM_NVLINK_PEER_NONE)
        rc = NVML_ERROR_NOT_SUPPORTED; /* inactive link: nothing at the other end */
    else if (peer == SIM_NVLINK_PEER_SWITCH)
        fill_switch_pci(g->switch_domain, pci, legacy_only);
    else
        sim_fill_pci_info(&ctx->spec->gpus[peer], pci, legacy_only);
    sim_leave();
    return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    return remote_pci(device, link, pci, true);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                           nvmlPciInfo_t *pci)
{
    return remote_pci(device, link, pci, false);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                           nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType)
{
    const struct sim_ctx *ctx;
    unsigned i;
    nvmlReturn_t rc = enter_link(device, link, &ctx, &i);
    if (rc != NVML_SUCCESS)
        return rc;
    int peer = ctx->spec->gpus[i].link_peer[link];
    if (pNvLinkDeviceType == NULL)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (peer == SIM_NVLINK_PEER_NONE)
        rc = NVML_ERROR_NOT_SUPPORTED;
    else
        *pNvLinkDeviceType = peer == SIM_NVLINK_PEER_SWITCH ? NVML_NVLINK_DEVICE_TYPE_SWITCH : NVML_NVLINK_DEVICE_TYPE_GPU;
    sim_leave();
    return rc;
}

/*
 * P2P: NVLINK is OK exactly for the pairs in the spec's nvlink list.  READ,
 * WRITE, ATOMICS and PCI are OK over NVLink, or over PCIe when the two GPUs
 * meet at or below a host bridge (level <= NVML_TOPOLOGY_HOSTBRIDGE).
 */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2,
                                               nvmlGpuP2PCapsIndex_t p2pIndex, nvmlGpuP2PStatus_t *p2pStatus)
{
    const struct sim_ctx *ctx;
    unsigned a;
    nvmlReturn_t rc = sim_enter_device(device1, &ctx, &a);
    if (rc != NVML_SUCCESS)
        return rc;
    int b = sim_handle_index(ctx, device2);
    if (b < 0 || p2pStatus == NULL || (unsigned)p2pIndex >= (unsigned)NVML_P2P_CAPS_INDEX_UNKNOWN) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (sim_gpu_lost(ctx, (unsigned)b)) {
        rc = NVML_ERROR_GPU_IS_LOST;
    } else {
        bool linked = sim_spec_nvlink_links(ctx->spec, a, (unsigned)b) > 0;
        bool pcie = ctx->spec->topology[a][b] <= NVML_TOPOLOGY_HOSTBRIDGE;
        if (p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK)
            *p2pStatus = linked ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
        else
            *p2pStatus = (linked || pcie) ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED;
    }
    sim_leave();
    return rc;
}
