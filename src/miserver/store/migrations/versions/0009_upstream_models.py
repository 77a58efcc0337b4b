"""upstream models: each upstream's discovered model list, remembered so a gateway restarted while it is down knows it

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('upstreams',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('base_url', sa.Text(), nullable=False),
    sa.Column('updated_at', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_upstreams'))
    )
    op.create_table('upstream_models',
    sa.Column('upstream', sa.String(length=128), nullable=False),
    sa.Column('model', sa.String(length=512), nullable=False),
    sa.Column('context_length', sa.Integer(), nullable=True),
    sa.Column('last_seen_at', sa.BigInteger(), nullable=False),
    sa.CheckConstraint('context_length IS NULL OR context_length > 0', name=op.f('ck_upstream_models_context_length')),
    sa.ForeignKeyConstraint(['upstream'], ['upstreams.name'], name=op.f('fk_upstream_models_upstream_upstreams'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('upstream', 'model', name=op.f('pk_upstream_models'))
    )


def downgrade() -> None:
    op.drop_table('upstream_models')
    op.drop_table('upstreams')
